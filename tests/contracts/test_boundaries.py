"""Import boundaries: the contracts stay light, no serving process (nor the operator) reaches
the lab or matplotlib, the gateway and the operator run without torch or transformers, and
``flowprefill/`` has no import cycle, counting the imports made inside functions."""

from __future__ import annotations

import ast
import functools
import importlib.util
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import flowprefill_operator
import pytest

import flowprefill
from flowprefill.contracts import Endpoint, GatewayConfig, SLOTable

PACKAGE_DIR = Path(flowprefill.__file__).parent
OPERATOR_DIR = Path(flowprefill_operator.__file__).parent
HEAVY = ("torch", "transformers", "vllm")

PROCESSES = {
    "serve-prefill": "flowprefill.prefill.server.cli",
    "serve-gateway": "flowprefill.gateway.cli",
    "operator": "flowprefill_operator.handlers",
}
"""Each serving process (the image's entry point) and the module it starts from."""
LAB = ("flowprefill.lab", "matplotlib")
"""What no serving process may import: the lab, and the plotting library it brings."""


def run_fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter (this test process has long imported torch and
    more); its stdout, or the test fails with its stderr."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def blocking(names: Iterable[str]) -> str:
    """Source that makes ``names`` look not installed in the interpreter it runs in: ``import``
    raises ImportError and ``importlib.util.find_spec`` answers None, as without the package
    (transformers probes for torch with find_spec; a meta-path finder that raised would
    crash that probe instead of answering it)."""
    return f"import sys\nfor _name in {sorted(names)!r}:\n    sys.modules[_name] = None\n"


def test_contracts_import_without_torch_transformers_or_vllm() -> None:
    out = run_fresh(
        "import sys, flowprefill.contracts, pkgutil, importlib\n"
        "for m in pkgutil.iter_modules(flowprefill.contracts.__path__):\n"
        "    importlib.import_module('flowprefill.contracts.' + m.name)\n"
        f"print(','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    assert out.strip() == "", f"importing the contracts pulled in {out.strip()}"


# --- the import graph -----------------------------------------------------------------------


def module_name(path: Path, root: Path) -> str:
    """Dotted name of ``path`` inside the package directory ``root``."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_names(path: Path, name: str, deferred: bool) -> set[str]:
    """Every dotted name ``path`` imports, and for ``from X import y`` also ``X.y`` (a
    submodule, or an attribute: the caller keeps what is a module). ``deferred``: count the
    imports made inside functions too (they run when the function does); otherwise the
    module level only, ``if``/``try`` blocks (``TYPE_CHECKING`` included: a cycle of types
    is still a cycle) counted."""
    tree = ast.parse(path.read_text())
    if deferred:
        nodes: Iterable[ast.AST] = ast.walk(tree)
    else:
        top: list[ast.AST] = []
        body: list[ast.stmt] = list(tree.body)
        while body:
            node = body.pop(0)
            top.append(node)
            if isinstance(node, ast.If | ast.Try):
                body.extend(node.body)
                body.extend(node.orelse)
                if isinstance(node, ast.Try):
                    body.extend(node.finalbody)
                    for handler in node.handlers:
                        body.extend(handler.body)
        nodes = top
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for each in nodes:
        if isinstance(each, ast.Import):
            found.update(a.name for a in each.names)
        elif isinstance(each, ast.ImportFrom):
            if each.level:
                base = package[: len(package) - (each.level - 1)]
                target = ".".join([*base, each.module] if each.module else base)
            else:
                target = each.module or ""
            found.add(target)
            found.update(f"{target}.{a.name}" for a in each.names)
    return found


@functools.cache
def import_graph(roots: tuple[Path, ...], deferred: bool) -> dict[str, set[str]]:
    """Our modules (every ``.py`` under the package directories ``roots``) → the modules of
    ours each imports, and the third-party top-level packages it imports."""
    paths = {module_name(p, root): p for root in roots for p in root.rglob("*.py")}
    ours = {root.name for root in roots}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        edges = set()
        for target in imported_names(path, name, deferred):
            if target in paths:
                edges.add(target)
            elif target.split(".")[0] not in ours:
                edges.add(target.split(".")[0])
        graph[name] = edges - {name}
    return graph


def with_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The graph with what Python also runs: importing ``a.b.c`` runs ``a`` and ``a.b``
    first (not counted for cycles: a package may import its own submodules)."""
    return {
        m: ws | {".".join(w.split(".")[:i]) for w in ws for i in range(1, w.count(".") + 1)}
        for m, ws in graph.items()
    }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of two or more modules (Tarjan), sorted; ``graph``
    holds our own modules only (:func:`own_edges`)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for m in sorted(graph):
        if m not in index:
            visit(m)
    return sorted(cycles)


def own_edges(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The edges between our own modules only."""
    return {m: {w for w in ws if w in graph} for m, ws in graph.items()}


def a_chain(graph: dict[str, set[str]], start: str, goal: str) -> list[str]:
    """A shortest import chain from ``start`` to ``goal`` (breadth first), for messages."""
    came: dict[str, str] = {start: start}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w not in came:
                    came[w] = v
                    if w == goal:
                        chain = [w]
                        while chain[-1] != start:
                            chain.append(came[chain[-1]])
                        return chain[::-1]
                    nxt.append(w)
        frontier = nxt
    return []


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen = {start}
    todo = [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


def is_lab(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in LAB)


def test_no_import_cycle_inside_flowprefill() -> None:
    graph = own_edges(import_graph((PACKAGE_DIR,), deferred=True))
    cycles = find_cycles(graph)
    # Any path from a member's successor in its component back to it stays in the component.
    chains = [" → ".join([c[0], *a_chain(graph, min(graph[c[0]] & set(c)), c[0])]) for c in cycles]
    assert cycles == [], "import cycles (imports inside functions counted):\n" + "\n".join(
        f"{chain}  (component: {', '.join(c)})" for chain, c in zip(chains, cycles, strict=True)
    )


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_no_serving_process_can_reach_the_lab(process: str) -> None:
    # Static, transitive, with every import inside a function counted: also what a code
    # path taken only on some request or some setting would import.
    graph = with_packages(import_graph((PACKAGE_DIR, OPERATOR_DIR), deferred=True))
    entry = PROCESSES[process]
    bad = sorted(m for m in reachable(graph, entry) if is_lab(m))
    assert bad == [], f"{process} reaches {bad}: " + " → ".join(a_chain(graph, entry, bad[0]))


@pytest.mark.parametrize("process", sorted(PROCESSES))
def test_a_serving_process_does_not_load_the_lab(process: str) -> None:
    # Dynamic: the entry module, then every module its functions import (its handlers'
    # deferred imports), then what is loaded.
    entry = PROCESSES[process]
    spec = importlib.util.find_spec(entry)
    assert spec is not None and spec.origin is not None, entry
    source = Path(spec.origin)
    handlers = sorted(
        m
        for m in imported_names(source, entry, deferred=True)
        if m.split(".")[0] in {"flowprefill", "flowprefill_operator"}
    )
    out = run_fresh(
        f"""
        import importlib, json, sys
        importlib.import_module({entry!r})
        for name in {handlers!r}:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name != name:  # an attribute (from X import y), not a module
                    raise
        print(json.dumps(sorted(sys.modules)))
        """
    )
    bad = sorted(m for m in json.loads(out) if is_lab(m))
    assert bad == [], f"{process} loaded {bad}"


def test_the_cli_imports_no_subcommand_module_until_one_is_chosen() -> None:
    out = run_fresh(
        """
        import json, sys
        from flowprefill import cli
        cli.build_parser(["--help"])
        print(json.dumps(sorted(sys.modules)))
        """
    )
    loaded = set(json.loads(out))
    ours = {m for m in loaded if m.startswith("flowprefill.")}
    assert ours <= {"flowprefill.cli", "flowprefill.errors"}, sorted(ours)
    assert not loaded & {*HEAVY, "matplotlib", "fastapi", "numpy"}


# --- gateway and operator without torch or transformers -------------------------------------


def test_gateway_and_operator_import_without_torch_transformers_or_matplotlib() -> None:
    out = run_fresh(
        blocking(["torch", "transformers", "matplotlib"])
        + """
import flowprefill.gateway.app, flowprefill.gateway.cli
import flowprefill_operator.handlers
from flowprefill import cli
args = cli.build_parser(["serve-gateway"]).parse_args(
    ["serve-gateway", "--config", "g.json", "--slo-table", "t.json"]
)
print(args.command)
"""
    )
    assert out.split() == ["serve-gateway"]


@pytest.fixture(scope="module")
def gateway_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """gateway.json (tiny-llama's tokenizer, one prefill instance never called) and a
    slo-table.json, as the operator mounts them."""
    from flowprefill.models import named_model_dir

    tmp = tmp_path_factory.mktemp("gateway")
    model_dir = named_model_dir("tiny-llama", cache_dir=tmp / "models")
    config = GatewayConfig(
        service="t",
        model_name="tiny",
        tokenizer_path=str(model_dir),
        prefill=[Endpoint.at("p", "127.0.0.1", 9)],
        decode=[],
    )
    (tmp / "gateway.json").write_text(config.model_dump_json())
    (tmp / "slo-table.json").write_text(SLOTable.paper().model_dump_json())
    return tmp / "gateway.json", tmp / "slo-table.json"


def test_serve_gateway_builds_its_app_without_torch_transformers_or_matplotlib(
    gateway_files: tuple[Path, Path],
) -> None:
    # serve-gateway as its image runs it, up to the server: uvicorn.run is where it stops.
    config, table = gateway_files
    out = run_fresh(
        blocking(["torch", "transformers", "matplotlib"])
        + f"""
import uvicorn
served = []
uvicorn.run = lambda app, **kw: served.append(app)
from flowprefill import cli
code = cli.main(["serve-gateway", "--config", {str(config)!r}, "--slo-table", {str(table)!r}])
print(code, len(served))
"""
    )
    assert out.split() == ["0", "1"]


# --- the checkers themselves ----------------------------------------------------------------


def write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "flowprefill"


def test_the_cycle_finder_finds_a_cycle_of_types(tmp_path: Path) -> None:
    pkg = write_package(
        tmp_path,
        {
            "flowprefill/__init__.py": "",
            "flowprefill/kv/__init__.py": "",
            "flowprefill/kv/params.py": "from flowprefill.kv.transport import check\n",
            "flowprefill/kv/transport.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .params import Ref\n"
            ),
        },
    )
    graph = own_edges(import_graph((pkg,), deferred=False))
    assert find_cycles(graph) == [["flowprefill.kv.params", "flowprefill.kv.transport"]]


def test_the_cycle_finder_counts_imports_inside_functions(tmp_path: Path) -> None:
    pkg = write_package(
        tmp_path,
        {
            "flowprefill/__init__.py": "",
            "flowprefill/a.py": "from flowprefill import b\n",
            "flowprefill/b.py": "def f():\n    from flowprefill.a import x\n    return x\n",
        },
    )
    assert find_cycles(own_edges(import_graph((pkg,), deferred=False))) == []
    graph = own_edges(import_graph((pkg,), deferred=True))
    assert find_cycles(graph) == [["flowprefill.a", "flowprefill.b"]]


def test_the_reach_check_follows_deferred_imports_to_third_party_packages(tmp_path: Path) -> None:
    pkg = write_package(
        tmp_path,
        {
            "flowprefill/__init__.py": "",
            "flowprefill/serve.py": "def run():\n    from flowprefill.report import plot\n",
            "flowprefill/report.py": "def plot():\n    import matplotlib.pyplot\n",
        },
    )
    graph = import_graph((pkg,), deferred=True)
    assert "matplotlib" in reachable(graph, "flowprefill.serve")
    assert a_chain(graph, "flowprefill.serve", "matplotlib") == [
        "flowprefill.serve",
        "flowprefill.report",
        "matplotlib",
    ]
