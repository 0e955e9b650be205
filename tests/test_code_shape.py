"""The shape the code keeps where its weight sits (issue 56): in the policy core, the runtime and the
server, no class over 300 lines and no function over 50, and no class name used twice under plexrl/
(a reader who meets `Node` or `Service` knows which one it is). Read from the source with `ast`, so a
class that grows past its limit fails here, naming itself, rather than in a later review."""

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "plexrl"
KEPT_SMALL = ("policy", "runtime", "serve")
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 50


def _trees(folder: Path):
    for path in sorted(folder.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent), ast.parse(path.read_text(), str(path))


def _lines(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def test_no_class_or_function_over_its_limit():
    over = []
    for part in KEPT_SMALL:
        for path, tree in _trees(PACKAGE / part):
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and _lines(node) > MAX_CLASS_LINES:
                    over.append(f"{path}:{node.lineno} class {node.name}: {_lines(node)} lines (at most {MAX_CLASS_LINES})")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _lines(node) > MAX_FUNCTION_LINES:
                    over.append(f"{path}:{node.lineno} {node.name}(): {_lines(node)} lines (at most {MAX_FUNCTION_LINES})")
    assert not over, "split these by what each part does:\n" + "\n".join(over)


def test_class_names_are_unique():
    where = defaultdict(list)
    for path, tree in _trees(PACKAGE):
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                where[node.name].append(f"{path}:{node.lineno}")
    twice = {name: places for name, places in where.items() if len(places) > 1}
    assert not twice, f"class names defined more than once under plexrl/ (rename one of each): {twice}"
