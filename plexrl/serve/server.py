"""`plexrl serve`: the command, and `Server`, which runs the service on a socket (tests and
benchmarks start one in-process on a free loopback port).

    plexrl serve --model /models/tiny [--model NAME=PATH ...] [--engine process|local|ray]
                 [--host 127.0.0.1] [--port 8000] [--api-keys FILE] [--state-dir DIR]

The server is stateless apart from `--state-dir` (runs and checkpoints, see store.py) and the
sessions it holds in memory: several servers may share one state directory behind a load
balancer that sends each session's requests to the server that created it (sticky on the
session id, which every request names).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import socket
import sys
import threading
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from plexrl.api import errors

if TYPE_CHECKING:
    from plexrl.serve.edge import EdgeLimits
    from plexrl.serve.limits import Limits
    from plexrl.serve.tenants import Tenants

log = logging.getLogger("plexrl.serve")


class Server:
    """Uvicorn serving `app` on a socket bound now (port 0: a free one), in a thread of its own."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
        import uvicorn

        # IPPROTO_TCP named, not 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP, and
        # without it Nagle holds each response's body behind its headers for the client's delayed ACK
        # (~40 ms a round trip on Linux loopback)
        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                                    socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))
        self.host, self.port = host, self.socket.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=60,
                                access_log=False)
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "Server":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self.socket]},
                                        name="plexrl-serve-http", daemon=True)
        self._thread.start()
        waited = 0.0
        while not self._server.started:
            if not self._thread.is_alive() or waited > timeout:
                raise RuntimeError(f"the server on {self.url} did not start within {timeout} s")
            threading.Event().wait(0.02)
            waited += 0.02
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self.socket.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def parse_models(values: list[str]) -> dict[str, str]:
    """`--model PATH` serves PATH under its own name; `--model NAME=PATH` under NAME."""
    models: dict[str, str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = value, value
        folder = Path(path)
        if not (folder / "config.json").is_file():
            raise errors.ConfigError(f"--model {value!r}: {path!r} is not a Hugging Face model folder "
                                     "(no config.json); expected a local folder, e.g. one `plexrl tiny-model` wrote")
        if name in models:
            raise errors.ConfigError(f"--model {value!r}: the name {name!r} is given twice")
        models[name] = str(folder.resolve())
    return models


def max_context(folders) -> int | None:
    """The longest `max_position_embeddings` among the model folders' configs (None if none says)."""
    import json

    found = []
    for folder in folders:
        try:
            found.append(int(json.loads((Path(folder) / "config.json").read_text())["max_position_embeddings"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return max(found, default=None)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def build_parser() -> argparse.ArgumentParser:
    from plexrl.engines import add_engine_option

    parser = argparse.ArgumentParser(prog="plexrl serve", description=__doc__.split("\n\n")[0])
    add_engine_option(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", action="append", default=[], metavar="PATH | NAME=PATH",
                        help="a local Hugging Face folder to serve (repeatable)")
    parser.add_argument("--api-keys", metavar="FILE", help="lines 'TENANT KEY' (keys start with tml-); without it "
                        "the server has one tenant and binds only loopback")
    parser.add_argument("--state-dir", default="plexrl-serve", help="runs, checkpoints and their records")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--device-memory-mib", type=int, default=256)
    parser.add_argument("--host-memory-mib", type=int, default=2048)
    parser.add_argument("--session-timeout", type=float, default=120.0,
                        help="seconds without a heartbeat after which a session is finished")
    parser.add_argument("--poll-hold", type=float, default=25.0, help="seconds a retrieve_future poll is held")
    parser.add_argument("--max-body-mib", type=int, default=32, help="largest protobuf body (forward_backward)")
    parser.add_argument("--max-json-mib", type=int, help="largest JSON body (default: 64 KiB + 12 bytes a token of the "
                        "longest context among the served models, the prompt of an asample; 4 MiB if none says)")
    parser.add_argument("--edge-workers", type=int, default=8,
                        help="threads that parse and handle requests; one tenant holds at most half of them")
    parser.add_argument("--queued-per-tenant", type=int, default=1024,
                        help="requests a tenant may have submitted and not finished")
    parser.add_argument("--events-kept", type=int, default=1_000_000, metavar="N",
                        help="event records each event log keeps in memory (past it the oldest half goes); "
                        "a server runs for days, and every request logs a few")
    return parser


@dataclass(frozen=True)
class Settings:
    """What the command line asks of a server, checked before any cluster starts."""

    models: dict[str, str]
    tenants: Tenants
    state_dir: Path
    limits: Limits
    edge: EdgeLimits


def settings(args: argparse.Namespace) -> Settings:
    """The command line's models, tenants and limits; InvalidInput naming what does not fit."""
    from plexrl.serve.edge import EdgeLimits
    from plexrl.serve.limits import Limits
    from plexrl.serve.tenants import Tenants

    models = parse_models(args.model)
    if not models:
        raise errors.ConfigError("no model to serve; give --model PATH (or NAME=PATH) at least once")
    tenants = Tenants.from_file(args.api_keys) if args.api_keys else Tenants()
    if tenants.open and not _is_loopback(args.host):
        raise errors.ConfigError(f"--host {args.host} without --api-keys: a server without keys binds only a "
                                 "loopback address (127.0.0.1); give --api-keys FILE to serve a network")
    limits = Limits(session_timeout_s=args.session_timeout, poll_hold_s=args.poll_hold,
                    queued_per_tenant=args.queued_per_tenant)
    json_bytes = {} if args.max_json_mib is None else {"max_json_bytes": args.max_json_mib << 20}
    edge = EdgeLimits.for_context(max_context(models.values()), max_body_bytes=args.max_body_mib << 20,
                                  workers=args.edge_workers, tenant_share=max(1, args.edge_workers // 2),
                                  **json_bytes)
    limits.validate(), edge.validate()
    return Settings(models, tenants, Path(args.state_dir).resolve(), limits, edge)


def main(argv: list[str] | None = None) -> int:
    try:
        import tinker.proto.tinker_public_pb2  # noqa: F401  (the wire schema)
    except ImportError:
        print("plexrl serve: the Tinker SDK is not installed; pip install 'plexrl[serve]' (tinker==0.38.0)",
              file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        given = settings(args)
    except errors.InvalidInput as exc:
        print(f"plexrl serve: {exc}", file=sys.stderr)
        return 2
    serve(args, given)
    return 0


def serve(args: argparse.Namespace, given: Settings) -> None:
    """Start the cluster, the service and the server; run until Ctrl-C or SIGTERM, then close all three."""
    from plexrl import engines
    from plexrl.serve.app import create_app
    from plexrl.serve.service import TinkerService
    from plexrl.serve.store import Store

    state_dir, edge = given.state_dir, given.edge
    with ExitStack() as stack:
        stack.enter_context(engines.session(args.engine, args.devices))
        cluster = stack.enter_context(engines.open_cluster(
            args.engine, args.devices, device_memory_bytes=args.device_memory_mib << 20,
            host_memory_bytes=args.host_memory_mib << 20, checkpoint_dir=str(state_dir / "scratch-checkpoints"),
            torch_device=args.device, precision=args.precision, events_kept=args.events_kept))
        store = Store(state_dir)
        stack.callback(store.close)
        service = TinkerService(cluster, store, given.models, given.tenants, given.limits, edge=edge)
        stack.callback(service.close)
        server = Server(create_app(service), args.host, args.port).start()
        print(f"plexrl serve: {server.url} ({args.engine} engine, {args.devices} devices; models: "
              f"{', '.join(sorted(given.models))}; state in {state_dir}; bodies up to {edge.max_json_bytes:,} bytes "
              f"of JSON, {edge.max_body_bytes:,} of protobuf)", flush=True)
        signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as Ctrl-C does: sessions finished, workers closed
        try:
            server._thread.join()
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()
