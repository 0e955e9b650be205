"""The routes of `plexrl serve`, one router per part of the Tinker protocol (sessions, models,
sampling, futures, runs), each handler reading its caller and body through the dependencies of
caller.py and handing typed values (plexrl/serve/bodies.py) to the service."""
