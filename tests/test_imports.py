"""The package's import graph, lazy (function-level) imports included, has no cycle."""
import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@functools.cache
def _graph(package: Path = REPO / "stem") -> dict[str, set[str]]:
    """Module -> the stem modules it imports anywhere in its source (``from stem.x import y`` counts as
    ``stem.x.y`` when that is a module, else ``stem.x``). Built once for this file's tests (the sources do not
    change while they run): do not mutate it."""
    mods = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
            for p in package.rglob("*.py")}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in mods:
                subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
                deps |= subs or {node.module}
        graph[name] = deps - {name, "stem"}
    return graph


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == "open":
                return stack[stack.index(d):] + [d]
            if d not in state and (c := visit(d)):
                return c
        state[m] = "done"
        stack.pop()
        return None

    for m in sorted(graph):
        if m not in state and (c := visit(m)):
            return c
    return None


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_lazy_imports():
    assert "stem.io" in _graph()["stem.pipeline"]                      # inside a function
    assert "stem.train.distributed" in _graph()["stem.train.loop"]     # from stem.train import distributed
    assert "stem.config" in _graph()["stem.report.params"]             # from stem import config as C


def test_no_import_cycle():
    assert _cycle(_graph()) is None
