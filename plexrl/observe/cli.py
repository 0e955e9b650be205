"""`plexrl dashboard --events FILE | --url URL [--key-file FILE] [--host H] [--port P] [--window S]`:
the dashboard of a finished or running cluster, served on this machine.

- `--events FILE`: an event log (`event_log=PATH`, `plexrl demo --out`, `plexrl sim --trace`); the
  page follows the file while it grows (a cluster still writing it), re-reading only what was added;
- `--url URL`: a running `plexrl serve` (or `--metrics-port`) server: its data, fetched with the
  operator key read from `--key-file` (or $PLEXRL_OPERATOR_KEY), never put on a command line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

from fastapi import FastAPI

from plexrl.errors import ConfigError
from plexrl.observe import dashboard
from plexrl.observe.web import Refused, mount


class FollowedLog:
    """An event log read as it grows: each call parses only the lines added since the last."""

    def __init__(self, path: Path):
        if not path.is_file():
            raise ConfigError(f"event log {str(path)!r} does not exist; expected a JSONL file written by the runtime")
        self.path, self.records, self._offset, self._lock = path, [], 0, threading.Lock()

    def read(self) -> list[dict]:
        with self._lock, self.path.open("rb") as f:
            f.seek(self._offset)
            chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next read
            for line in complete.splitlines():
                if line.strip():
                    self.records.append(json.loads(line))
            self._offset += len(complete)
            return list(self.records)


def remote_data(url: str, key: str | None):
    def fetch(window: float) -> dict:
        request = urllib.request.Request(f"{url.rstrip('/')}/dashboard/data?window={window:g}",
                                         headers={"X-API-Key": key} if key else {})
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            raise Refused(exc.code if exc.code in (401, 403) else 502,
                          f"{url} answered {exc.code}: {exc.read()[:300].decode(errors='replace')}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise Refused(502, f"{url} did not answer: {exc}") from None

    return fetch


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="plexrl dashboard", description="the dashboard of a finished or running cluster")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--events", type=Path, metavar="FILE",
                        help="an event log (JSON lines) to show, followed as it grows")
    source.add_argument("--url", help="a running plexrl serve (or --metrics-port) server to show, "
                                      "e.g. http://host:8000")
    p.add_argument("--key-file", type=Path, help="a file holding the operator key for --url (default: "
                                                  "$PLEXRL_OPERATOR_KEY)")
    p.add_argument("--host", default="127.0.0.1", help="address to serve the page on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8265, help="port to serve the page on (default 8265; 0: a free one)")
    p.add_argument("--devices-per-node", type=int, help="devices a job's node group holds, for its cost against "
                                                        "dedicated devices (default: as many as the log shows)")
    return p.parse_args(argv)


def build_app(args: argparse.Namespace) -> FastAPI:
    app = FastAPI(title="PlexRL dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    if args.events is not None:
        log = FollowedLog(args.events)
        mount(app, None, lambda window: dashboard.from_events(log.read(), window, args.devices_per_node))
    else:
        key = args.key_file.read_text().strip() if args.key_file else os.environ.get("PLEXRL_OPERATOR_KEY")
        mount(app, None, remote_data(args.url, key))
    return app


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    from plexrl.serve.server import Server

    try:
        app = build_app(args)
    except (ConfigError, OSError) as exc:
        print(f"plexrl dashboard: {exc}", file=sys.stderr)
        return 2
    with Server(app, args.host, args.port) as server:
        print(f"plexrl dashboard: {server.url}/dashboard", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as Ctrl-C does
        with contextlib.suppress(KeyboardInterrupt):
            server._thread.join()
    return 0
