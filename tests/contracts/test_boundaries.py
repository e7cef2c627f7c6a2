"""Import boundaries: the contracts stay light, and ``flowprefill/`` has no import cycle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import flowprefill

PACKAGE_DIR = Path(flowprefill.__file__).parent
HEAVY = ("torch", "transformers", "vllm")


def test_contracts_import_without_torch_transformers_or_vllm() -> None:
    # A fresh interpreter: this test process has long imported torch.
    code = (
        "import sys, flowprefill.contracts, pkgutil, importlib\n"
        "for m in pkgutil.iter_modules(flowprefill.contracts.__path__):\n"
        "    importlib.import_module('flowprefill.contracts.' + m.name)\n"
        f"print(','.join(sorted(m for m in {HEAVY!r} if m in sys.modules)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"importing the contracts pulled in {out.stdout.strip()}"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE_DIR.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Modules of ours that ``path`` imports at module level (``if TYPE_CHECKING:`` blocks
    included: a cycle of types is still a cycle; imports inside functions are deferred on
    purpose and not counted)."""
    name = _module_name(path)
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If | ast.Try):
            body.extend(node.body)
            body.extend(getattr(node, "orelse", []))
            for handler in getattr(node, "handlers", []):
                body.extend(handler.body)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif target in modules:
                    found.add(target)
    found.discard(name)
    return found


def find_cycles(package_dir: Path) -> list[list[str]]:
    paths = {_module_name(p): p for p in package_dir.rglob("*.py")}
    modules = set(paths)
    graph = {m: _imports(p, modules) for m, p in paths.items()}
    # Tarjan's strongly connected components; any component of two or more is a cycle.
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
    return cycles


def test_no_import_cycle_inside_flowprefill() -> None:
    assert find_cycles(PACKAGE_DIR) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "flowprefill"
    (pkg / "kv").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "kv" / "__init__.py").write_text("")
    (pkg / "kv" / "params.py").write_text("from flowprefill.kv.transport import check\n")
    (pkg / "kv" / "transport.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .params import Ref\n"
    )
    global PACKAGE_DIR
    saved, PACKAGE_DIR = PACKAGE_DIR, pkg
    try:
        assert find_cycles(pkg) == [["flowprefill.kv.params", "flowprefill.kv.transport"]]
    finally:
        PACKAGE_DIR = saved
