"""`plexrl serve`: an HTTP server the unmodified Tinker SDK talks to, in front of a PlexRL cluster."""
