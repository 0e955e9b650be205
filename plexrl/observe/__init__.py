"""Watching a cluster: Prometheus metrics (prometheus.py), Chrome/Perfetto traces of an event log
(perfetto.py), and a live dashboard (dashboard.py, web.py, static/).

Everything here reads what the runtime already reports, `cluster.metrics()`, `cluster.recent()`
and the event log, and changes nothing: an observer never slows a decision down or alters one.
"""
