"""The docs' reference pages, generated from the code at every `mkdocs build` (an mkdocs hook).

A page asks for a generated part with a marker line, `<!-- reference: NAME -->`; `on_page_markdown`
replaces it with the markdown that `GENERATORS[NAME]()` makes from the code itself:
- `cli`: every `plexrl` command's flags, read from its argparse parser (captured as the command's
  `main` calls `parse_args`, so a flag added to any parser appears without touching the docs);
- `config`: `ClusterConfig`'s fields from the dataclass (name, type, default) with the comment
  written beside each field in `plexrl/runtime/config.py` (its meaning);
- `errors`: every exception of `plexrl.errors`, its docstring, and where the code raises it;
- `workload-schema`, `cluster-schema`, `jobs-schema`: the pydantic models of the simulator's
  workload and cluster files and of `plexrl run`'s jobs file.
The metrics page is written by hand; `tests/test_docs.py` checks it names every key a real
cluster's `metrics()` returns, every flag and every field the pages here generate from.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import re
import tokenize
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- reference: ([a-z-]+) -->$", re.MULTILINE)


# -- the CLI ----------------------------------------------------------------------------------------------
class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser


def _capture(main, argv: list[str]) -> argparse.ArgumentParser:
    """The parser `main(argv)` builds: stopped where it would parse, before the command runs."""
    def stop(self, *args, **kwargs):
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = stop
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            main(argv)
    except _Captured as captured:
        return captured.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
    raise RuntimeError(f"{main.__module__}.main({argv}) returned without parsing its arguments")


def parsers() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, by its command line (`plexrl sim calibrate`)."""
    from plexrl import bench, cli

    out = {}
    for name, (module, func, _) in cli.COMMANDS.items():
        main = getattr(importlib.import_module(module), func)
        if name == "bench":
            for bench_name in bench.BENCHES:
                out[f"plexrl bench {bench_name}"] = _capture(main, [bench_name])
            continue
        out[f"plexrl {name}"] = _capture(main, [])
        if name == "sim":
            out["plexrl sim calibrate"] = _capture(main, ["calibrate"])
    return out


def flags(parser: argparse.ArgumentParser) -> list[str]:
    """A parser's option strings and positional names, help excluded."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        out += action.option_strings or [action.dest]
    return out


def _cell(text) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _action_row(action: argparse.Action) -> str:
    if action.option_strings:
        name = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.nargs != 0:
            name += f" `{action.metavar or action.dest.upper()}`"
    else:
        name = f"`{action.metavar or action.dest}`" + (" (optional)" if action.nargs == "?" else "")
    if action.choices:
        accepts = " or ".join(f"`{c}`" for c in action.choices)
    elif action.nargs == 0:
        accepts = "flag"
    else:
        accepts = getattr(action.type, "__name__", "text") if action.type else "text"
        accepts = {"str": "text", "Path": "path"}.get(accepts, accepts)
        if action.nargs in ("*", "+") or isinstance(action, argparse._AppendAction):
            accepts += ", repeatable"
    default = action.default
    default = "" if default in (None, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
    return f"| {name} | {_cell(accepts)} | {default} | {_cell(action.help or '')} |"


def cli_reference() -> str:
    from plexrl import cli

    lines = ["`plexrl COMMAND [ARGS]`; `plexrl --help` lists the commands:", "",
             "| command | what it does |", "| --- | --- |"]
    lines += [f"| `plexrl {name}` | {_cell(help_)} |" for name, (_, _, help_) in cli.COMMANDS.items()]
    for command, parser in parsers().items():
        lines += ["", f"### `{command}`", ""]
        if parser.description:
            lines += [_cell(parser.description.strip().split("\n\n")[0]), ""]
        lines += ["```", parser.format_usage().strip().removeprefix("usage: "), "```", "",
                  "| argument | accepts | default | meaning |", "| --- | --- | --- | --- |"]
        lines += [_action_row(a) for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    return "\n".join(lines)


# -- ClusterConfig ----------------------------------------------------------------------------------------
def field_comments(cls) -> dict[str, str]:
    """Each dataclass field's comment in the source: the comment lines right above it and the one
    at the end of its line."""
    source = inspect.getsource(cls)
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            row, above = node.lineno, []
            while row - 1 in comments and lines[row - 2].lstrip().startswith("#"):
                row -= 1
                above.insert(0, comments[row])
            out[node.target.id] = " ".join(above + ([comments[node.lineno]] if node.lineno in comments else []))
    return out


def _type_name(annotation) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return text.replace("typing.", "")


def config_reference() -> str:
    from plexrl.runtime.config import ClusterConfig

    meanings = field_comments(ClusterConfig)
    lines = ["| setting | type | default | meaning |", "| --- | --- | --- | --- |"]
    for f in dataclasses.fields(ClusterConfig):
        lines.append(f"| `{f.name}` | `{_type_name(f.type)}` | `{f.default!r}` | {_cell(meanings.get(f.name, ''))} |")
    return "\n".join(lines)


# -- errors -----------------------------------------------------------------------------------------------
def raise_sites() -> dict[str, dict[str, list[str]]]:
    """Where the code makes each exception of plexrl.errors (raises it, or builds it for a future),
    read from the source: {exception: {module: [Class.function, ...]}}."""
    from plexrl import errors

    names = set(errors.__all__)
    sites: dict[str, dict[str, set[str]]] = {name: {} for name in names}

    def visit(node, module: str, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, module, [*scope, child.name])
                continue
            if isinstance(child, ast.Call):
                func = child.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name in names:
                    sites[name].setdefault(module, set()).add(".".join(scope) or "(module)")
            visit(child, module, scope)

    for path in sorted((ROOT / "plexrl").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        if module != "plexrl.api.errors":
            visit(ast.parse(path.read_text()), module, [])
    return {name: {m: sorted(f) for m, f in sorted(found.items())} for name, found in sites.items()}


def errors_reference() -> str:
    from plexrl import errors

    sites = raise_sites()
    lines = []
    ordered = sorted(errors.__all__, key=lambda n: (n != "PlexRLError", n))
    for name in ordered:
        cls = getattr(errors, name)
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__)
        doc = inspect.getdoc(cls) if cls.__doc__ else ""
        lines += [f"### `{name}`", "", f"Subclass of {bases}; retriable: **{'yes' if cls.retriable else 'no'}**.", ""]
        if doc and doc != inspect.getdoc(cls.__bases__[0]):
            lines += [" ".join(doc.split()), ""]
        if sites[name]:
            lines += ["Raised in:", ""]
            lines += [f"- `{module}`: " + ", ".join(f"`{f}`" for f in functions)
                      for module, functions in sites[name].items()]
            lines.append("")
        else:
            lines += ["Not raised by name: it stands for its subclasses (`except` it to catch them all).", ""]
    return "\n".join(lines)


# -- pydantic schemas -------------------------------------------------------------------------------------
def _constraints(info) -> str:
    out = []
    for item in info.metadata:
        for attr, sign in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "length >="),
                           ("pattern", "matches")):
            value = getattr(item, attr, None)
            if value is not None:
                out.append(f"{sign} `{value}`")
    return ", ".join(out)


def _annotation(annotation) -> str:
    text = str(annotation) if typing.get_origin(annotation) else getattr(annotation, "__name__", str(annotation))
    text = re.sub(r"\b(?:[a-z_]+\.)+([A-Za-z_]+)", r"\1", text.replace("typing.", ""))
    return text.replace("NoneType", "None")


def _models_under(model) -> list:
    """The model and every pydantic model its fields hold, depth first, each once."""
    from pydantic import BaseModel

    seen, order = set(), []

    def visit(m):
        if m in seen:
            return
        seen.add(m)
        order.append(m)
        for info in m.model_fields.values():
            for arg in [info.annotation, *typing.get_args(info.annotation)]:
                for inner in [arg, *typing.get_args(arg)]:
                    if isinstance(inner, type) and issubclass(inner, BaseModel):
                        visit(inner)

    visit(model)
    return order


def schema_reference(model, key_of: dict[str, str]) -> str:
    from pydantic_core import PydanticUndefined

    lines = []
    for m in _models_under(model):
        lines += [f"### `{key_of.get(m.__name__, m.__name__)}`", ""]
        doc = inspect.getdoc(m) if m.__doc__ else ""
        if doc and "pydantic" not in doc.lower():
            lines += [" ".join(doc.split()), ""]
        lines += ["| field | type | default | constraints | meaning |", "| --- | --- | --- | --- | --- |"]
        for name, info in m.model_fields.items():
            if info.default is PydanticUndefined and info.default_factory is None:
                default = "**required**"
            elif info.default_factory is not None:
                default = "see below" if hasattr(info.default_factory, "model_fields") else "`[]`"
            elif hasattr(info.default, "model_fields"):
                default = "see below"
            else:
                default = f"`{info.default!r}`"
            lines.append(f"| `{name}` | `{_cell(_annotation(info.annotation))}` | {default} | "
                         f"{_cell(_constraints(info))} | {_cell(info.description or '')} |")
        lines.append("")
    return "\n".join(lines)


def workload_schema() -> str:
    from plexrl.sim.workload import Workload

    return schema_reference(Workload, {"Workload": "workload file (top level)", "WorkloadJob": "jobs[]",
                                       "RolloutShape": "jobs[].rollout", "PoissonArrivals": "poisson"})


def cluster_schema() -> str:
    from plexrl.sim.workload import SimCluster

    return schema_reference(SimCluster, {"SimCluster": "cluster file (top level)", "Device": "device"})


def jobs_schema() -> str:
    from plexrl.rl.jobs_file import JobsFile

    return schema_reference(JobsFile, {"JobsFile": "jobs file (top level)", "ClusterSpec": "cluster",
                                       "JobSpec": "jobs[]", "ModelSpec": "jobs[].model"})


GENERATORS = {"cli": cli_reference, "config": config_reference, "errors": errors_reference,
              "workload-schema": workload_schema, "cluster-schema": cluster_schema, "jobs-schema": jobs_schema}


# -- the mkdocs hook --------------------------------------------------------------------------------------
def on_page_markdown(markdown: str, page, config, files) -> str:
    return MARKER.sub(lambda m: GENERATORS[m.group(1)](), markdown)
