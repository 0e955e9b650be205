"""docs/design.md §9.6: the policy code is pure — no torch/ray/transformers, no clock, no I/O."""

from __future__ import annotations

import ast
import pkgutil
from pathlib import Path

import plexrl.policy
from tests.helpers import run_with_blocked_imports

POLICY_DIR = Path(plexrl.policy.__file__).parent
BLOCKED = ("torch", "ray", "transformers", "safetensors", "tokenizers")


def test_policy_imports_with_heavy_libraries_unimportable():
    modules = [f"plexrl.policy.{m.name}" for m in pkgutil.iter_modules([str(POLICY_DIR)])]
    body = f"""
import importlib
for m in {modules!r}:
    importlib.import_module(m)
print('ok', len({modules!r}))
"""
    result = run_with_blocked_imports(BLOCKED, body, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ok")


CLOCK_CALLS = {("time", "time"), ("time", "perf_counter"), ("time", "monotonic"), ("time", "sleep"),
               ("datetime", "now"), ("datetime", "utcnow"), ("random", "random")}
FORBIDDEN_MODULES = {"time", "datetime", "random", "os", "socket", "subprocess", "threading"}


def test_policy_reads_no_clock_and_does_no_io():
    for path in sorted(POLICY_DIR.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
                assert not names & FORBIDDEN_MODULES, f"{path.name} imports {names & FORBIDDEN_MODULES}"
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module.split(".")[0] not in FORBIDDEN_MODULES, f"{path.name} imports from {node.module}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "open", f"{path.name} opens a file"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                assert (node.value.id, node.attr) not in CLOCK_CALLS, f"{path.name} calls {node.value.id}.{node.attr}"
