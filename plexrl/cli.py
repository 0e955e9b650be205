"""The `plexrl` command. Each subcommand lives in its own module and parses its own flags."""

from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module, function taking argv, one-line help)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "demo": ("plexrl.rl.demo", "main", "run three RL jobs multiplexed vs dedicated and compare"),
    "run": ("plexrl.rl.jobs_file", "main", "run the jobs described in a YAML file"),
    "bench": ("plexrl.bench", "main", "benchmarks: switch, dispatch, placement, scale, cotenancy, faults"),
    "sim": ("plexrl.sim.cli", "main", "simulate a workload on a cluster at scale"),
    "serve": ("plexrl.serve.server", "main", "a Tinker-compatible network service (the Tinker SDK talks to it)"),
    "trace": ("plexrl.observe.perfetto", "main", "an event log as a Chrome/Perfetto trace (ui.perfetto.dev)"),
    "dashboard": ("plexrl.observe.cli", "main", "the live dashboard of an event log or of a running server"),
    "tiny-model": ("plexrl.models.tiny", "main", "write a small random model with its tokenizer"),
}


def usage() -> str:
    lines = ["usage: plexrl COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"plexrl: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, func, _ = COMMANDS[name]
    module = importlib.import_module(module_name)
    return int(getattr(module, func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
