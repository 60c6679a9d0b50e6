"""The layers point one way (DESIGN.md §9): an AST read of every module's imports, module-level
and inside functions alike, against the rules below; and no import cycles among our modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("specsplit", "drafter", "verifier", "gateway", "inprocess")
SERVICES = ("drafter", "verifier", "gateway", "inprocess")
# the command line: the composition root that starts the services
CLI_ROOT = frozenset(
    {
        "specsplit.cli",
        "specsplit.cli_flags",
        "specsplit.cli_server_flags",
        "specsplit.cli_serve",
        "specsplit.cli_generate",
        "specsplit.up",
    }
)
TORCH_ENGINES = (
    "verifier.engine",
    "verifier.device_rounds",
    "verifier.rounds",
    "verifier.hints",
    "verifier.round_accept",
    "drafter.engine",
    "drafter.types",
    "drafter.ngram",
    "drafter.model_proposer",
    "drafter.eagle_proposer",
    "drafter.tree_draft",
)
# train-drafter's held-out report runs the real engines through the in-process stack
DRAFTER_USES_INPROCESS = frozenset({"drafter.train_report"})


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, name: str) -> set[str]:
    """Every module `path` imports, at any depth (functions, TYPE_CHECKING blocks included)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # submodules
    return found


def _graph() -> dict[str, set[str]]:
    """Our modules -> the modules of ours each imports."""
    paths = {
        _module_name(p): p
        for package in PACKAGES
        for p in (ROOT / package).rglob("*.py")
        if "v1" not in p.relative_to(ROOT).parts[1:2]  # generated stubs
    }
    return {name: _imports(path, name) & set(paths) - {name} for name, path in paths.items()}


GRAPH = _graph()


def _violations(
    importers: str, forbidden: tuple[str, ...], exempt: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """(module, import) pairs where a module of package `importers` imports one under
    `forbidden` (a package or a module)."""
    return sorted(
        (module, imported)
        for module, imports in GRAPH.items()
        if module.split(".")[0] == importers and module not in exempt
        for imported in imports
        if any(imported == f or imported.startswith(f + ".") for f in forbidden)
    )


def test_the_graph_covers_every_package() -> None:
    assert {m.split(".")[0] for m in GRAPH} == set(PACKAGES)
    assert "specsplit.cli" in GRAPH and "gateway.scheduler" in GRAPH["inprocess.stack"]


def test_runtime_imports_no_service_except_the_command_line() -> None:
    assert _violations("specsplit", SERVICES, exempt=CLI_ROOT) == []


def test_gateway_imports_no_drafter_or_verifier_module() -> None:
    assert _violations("gateway", ("drafter", "verifier", "inprocess")) == []


def test_gateway_imports_no_torch_engine() -> None:
    assert _violations("gateway", TORCH_ENGINES) == []


def test_drafter_imports_no_gateway_or_verifier() -> None:
    assert _violations("drafter", ("gateway", "verifier")) == []
    assert _violations("drafter", ("inprocess",), exempt=DRAFTER_USES_INPROCESS) == []


def test_verifier_imports_no_gateway_or_drafter() -> None:
    assert _violations("verifier", ("gateway", "drafter", "inprocess")) == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package: str) -> None:
    """Module-level and function-level imports alike: a cycle hidden in a function is one."""
    cycles = [c for c in _cycles(GRAPH) if any(m.split(".")[0] == package for m in c)]
    assert cycles == []
