"""The package's layers: imports point down, no module imports itself through others, lazy imports say why.

The allowed order is written once, in :data:`LAYERS`; ``ARCHITECTURE.md`` draws the same picture.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "compress"
# Lowest first: a module may import from its own layer and the layers before it.
LAYERS = (
    "catalog",
    "core",
    "models",
    "algorithms",
    "transforms",
    "backends",
    "eval",
    "report",
    "pipeline",
    "runtime",
    "cli",
)
LAZY_MARK = "lazy:"  # in a comment on the import or the line above it: why the import waits


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The layer index of a ``compress`` module; the package itself and ``__main__`` sit on top."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return len(LAYERS)
    return LAYERS.index(parts[1])


def imports_of(path: Path) -> list[tuple[str, int, bool]]:
    """``(imported compress module, line, at module level)`` for every import of a compress module in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] == "compress"
            and node.level == 0
        ):
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            target = next((n for n in names if _is_module(n)), node.module)
            found.append((target if _is_module(target) else node.module, node.lineno, id(node) in top_level))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "compress":
                    found.append((alias.name, node.lineno, id(node) in top_level))
    return found


def _is_module(name: str) -> bool:
    relative = Path(*name.split("."))
    return (PACKAGE.parent / relative).with_suffix(".py").is_file() or (
        PACKAGE.parent / relative / "__init__.py"
    ).is_file()


def _type_checking_lines(path: Path) -> set[int]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            lines.update(child.lineno for child in ast.walk(node) if hasattr(child, "lineno"))
    return lines


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def graph() -> dict[str, set[str]]:
    return {name: {target for target, _, _ in imports_of(path) if target in MODULES and target != name}
            for name, path in MODULES.items()}


def test_every_module_is_in_a_layer():
    unplaced = [
        name for name in MODULES if len(name.split(".")) > 1 and name.split(".")[1] not in (*LAYERS, "__main__")
    ]
    assert unplaced == []


def test_imports_point_down_the_layers():
    upward = []
    for name, path in MODULES.items():
        ignored = _type_checking_lines(path)
        for target, line, _ in imports_of(path):
            if line not in ignored and layer_of(target) > layer_of(name):
                upward.append(f"{name}:{line} imports {target}")
    assert upward == []


def test_no_import_circles():
    edges = graph()
    circles = [component for component in _strongly_connected(edges) if len(component) > 1]
    assert circles == []


def test_local_imports_of_compress_say_why():
    unexplained = []
    for name, path in MODULES.items():
        lines = path.read_text(encoding="utf-8").splitlines()
        for _, line, top in imports_of(path):
            if top or line in _type_checking_lines(path):
                continue
            if LAZY_MARK not in lines[line - 1] and LAZY_MARK not in lines[line - 2]:
                unexplained.append(f"{name}:{line}: {lines[line - 1].strip()}")
    assert unexplained == []


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative over the modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    counter = 0

    def connect(start: str) -> None:
        nonlocal counter
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(edges):
        if node not in index:
            connect(node)
    return components


@pytest.mark.parametrize("edges, expected", [
    ({"a": {"b"}, "b": {"a"}, "c": set()}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
])
def test_the_circle_finder_finds_circles(edges, expected):
    assert [c for c in _strongly_connected(edges) if len(c) > 1] == expected


def _functions():
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path.relative_to(PACKAGE.parent), node


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    arguments = node.args
    named = [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
    count = len(named) + bool(arguments.vararg) + bool(arguments.kwarg)
    return count - bool(named and named[0].arg in ("self", "cls"))


def test_functions_are_short_and_take_few_parameters():
    """No function over 60 lines or with more than 7 parameters (parameter objects group the rest)."""
    too_long = [f"{path}:{node.lineno} {node.name}" for path, node in _functions()
                if node.end_lineno - node.lineno + 1 > 60]
    too_many = [f"{path}:{node.lineno} {node.name}" for path, node in _functions() if _parameters(node) > 7]
    assert not too_long, too_long
    assert not too_many, too_many


SEAM_PACKAGES = ("pipeline", "eval", "report", "transforms", "backends")
UNTYPED = ("dict[str, Any]", "Mapping[str, Any]")


def _untyped_signatures() -> dict[tuple[str, str], str]:
    """Public functions whose parameters or return are an untyped mapping, by (module, name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                signature = ast.unparse(node.args) + " -> " + (ast.unparse(node.returns) if node.returns else "")
                bare = any(isinstance(n, ast.Name) and n.id == "dict" and not isinstance(parent, ast.Subscript)
                           for parent in ast.walk(node.args) for n in ast.iter_child_nodes(parent))
                returns_bare = node.returns is not None and ast.unparse(node.returns) == "dict"
                if any(u in signature for u in UNTYPED) or bare or returns_bare:
                    found[(module, node.name)] = signature
    return found


def _package_of(module: str) -> str:
    return module.split(".")[1] if module.count(".") else ""


def _cross_package_uses() -> set[tuple[str, str, str]]:
    """(module, name, user) for each name one seam package takes from another: imported, or read off an imported
    module."""
    modules = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts) for p in PACKAGE.rglob("*.py")}
    uses = set()
    for path in PACKAGE.rglob("*.py"):
        user = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("compress."):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in modules:
                        aliases[alias.asname or alias.name] = full
                    else:
                        uses.add((node.module, alias.name, user))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                uses.add((aliases[node.value.id], node.attr, user))
    return {(m, n, u) for m, n, u in uses if _package_of(m) != _package_of(u)
            and {_package_of(m), _package_of(u)} <= set(SEAM_PACKAGES)}


def test_what_crosses_a_package_seam_is_typed():
    untyped = _untyped_signatures()
    crossing = sorted({(m, n) for m, n, _ in _cross_package_uses() if (m, n) in untyped})
    assert not crossing, [f"{m}.{n}({untyped[(m, n)]})" for m, n in crossing]


def test_the_seam_check_sees_crossings_and_untyped_signatures():
    # an untyped function used inside its own package is allowed; the checker still finds it
    assert ("compress.eval.decoder", "domain_quality") in _untyped_signatures()
    assert ("compress.eval.decoder", "measure", "compress.pipeline.stages.validate") in _cross_package_uses()
