"""The layers stay layers: a static walk of the import graph (every ``import``, at module level or
inside a function) from the services and the serving library must never reach the offline tools
(calibration, eval, bench, assets, data, the CLI, the demo, the client, the in-process harness).
Also: no Python file over 500 lines."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVING = ("shared", "producer_service", "consumer_service")
OFFLINE = "tools"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module(p): p for top in (*SERVING, OFFLINE) for p in (ROOT / top).rglob("*.py")}


def _imports(path: Path, name: str) -> set[str]:
    """Every module ``path`` imports, resolved to a module name (relative imports included)."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)  # "from pkg import module"
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for imp in _imports(path, name):
            while imp and imp not in mods:  # "pkg.mod.attr" -> "pkg.mod"
                imp = imp.rpartition(".")[0]
            if imp:
                deps.add(imp)
        graph[name] = deps
    return graph


def _reach(graph: dict[str, set[str]], start: str) -> dict[str, str]:
    """Every module reachable from ``start``, each with the module that first imported it."""
    seen, todo = {start: ""}, [start]
    while todo:
        m = todo.pop()
        for d in graph.get(m, ()):
            if d not in seen:
                seen[d] = m
                todo.append(d)
    return seen


def _chain(seen: dict[str, str], m: str) -> str:
    out = [m]
    while seen[out[-1]]:
        out.append(seen[out[-1]])
    return " <- ".join(out)


def test_serving_code_never_imports_the_offline_tools():
    graph = _graph()
    bad = []
    for start in sorted(m for m in graph if m.split(".")[0] in SERVING):
        seen = _reach(graph, start)
        bad += [_chain(seen, m) for m in seen if m.split(".")[0] == OFFLINE]
    assert not bad, "serving code imports offline tools:\n" + "\n".join(sorted(set(bad))[:20])


def test_the_walk_sees_imports_inside_functions(tmp_path):
    """The check would fail: a function-level import of a tool is found."""
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from tools.calibration import pipeline\n    import tools.eval.harness\n")
    assert {"tools.calibration", "tools.calibration.pipeline", "tools.eval.harness"} <= _imports(p, "m")


def test_no_python_file_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for top in (*SERVING, OFFLINE, "tests")
            for p in (ROOT / top).rglob("*.py") if "_pb2" not in p.name
            and (n := len(p.read_text().splitlines())) > 500}
    assert not long, f"split these modules (over 500 lines): {long}"
