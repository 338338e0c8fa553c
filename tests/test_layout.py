"""The code's layering, read from its imports: `loupe/` never imports `pipelines/` or `stages/`, a stage never
imports another stage, and no loupe module reaches itself through its imports (an import cycle)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of its code (a lazy import inside a function counts too)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _graph(top: str) -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in (ROOT / top).rglob("*.py")}
    return {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}


def test_loupe_imports_neither_pipelines_nor_stages():
    offenders = {name: sorted(m for m in _imports(path) if m.split(".")[0] in ("pipelines", "stages"))
                 for name, path in ((_module_name(p), p) for p in (ROOT / "loupe").rglob("*.py"))}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_no_stage_imports_another_stage():
    offenders = {}
    for path in (ROOT / "stages").rglob("*.py"):
        name = _module_name(path)
        own = name.split(".")[1] if "." in name else None
        others = sorted(m for m in _imports(path) if m.startswith("stages.") and m.split(".")[1] != own)
        if others:
            offenders[name] = others
    assert offenders == {}


def test_loupe_has_no_import_cycle():
    graph = _graph("loupe")
    # A package's __init__ re-exporting its own modules is no cycle: drop package -> own-submodule edges.
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
    cycles, state = [], {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(trail[trail.index(nxt):] + [nxt] if nxt in trail else [node, nxt])
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = "done"

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    assert cycles == []
