"""The import contract: the package's 15 layers, bottom to top (the workflow's job scripts on top), and which
may import which.

Every ``stem`` import of a unit (a subpackage such as ``stem.models``, a top-level module such as
``stem.config``, or the ``workflow_scripts`` package) goes to the unit itself or to a unit of the same or a lower
layer, lazy (function-level) imports included, and so does every registry entry written as a ``"module:attr"``
string (imported by name on first use, stem.registry.resolve), which must name a module of the tree and a name
defined at its top; and the units' import graph has no cycle (tests/test_imports.py checks the modules').
A new package or top-level module is added to ``LAYERS`` (one line) or the test says where it is missing.
docs/design.md shows the same table (checked). Below: no function of stem/, workflow_scripts/ or scripts/ is longer
than 59 lines (def line to last line).
"""
import ast
import re
from functools import lru_cache
from pathlib import Path

from test_imports import _cycle

REPO = Path(__file__).resolve().parents[1]

# bottom -> top; a unit may import its own layer's units and every layer below
LAYERS = [
    ("base", "stem stem.options stem.fields stem.plugins stem.registry stem.layout stem.io stem.provenance stem.seeds "
             "stem.resources stem.warm"),
    ("models", "stem.models"),
    ("optim", "stem.optim"),
    ("checkpoint", "stem.checkpoint"),
    ("data", "stem.data"),
    ("hf", "stem.hf"),
    ("specs", "stem.specs"),
    ("sweep points", "stem.sweeps stem.knowledge"),
    ("config", "stem.config"),
    ("train", "stem.train"),
    ("eval", "stem.eval"),
    ("analysis", "stem.analysis"),
    ("report", "stem.report"),
    ("entry points", "stem.pipeline stem.gpucheck stem.rehearsal stem.bench stem.cli_args "
                     "stem.__main__"),
    ("workflow scripts", "workflow_scripts"),
]
PACKAGES = (REPO / "stem", REPO / "workflow_scripts")
ENTRY = re.compile(r"((?:stem|workflow_scripts)(?:\.\w+)*):(\w+)")   # a registry's "module:attr" entry


def layer_of(layers=LAYERS) -> dict[str, int]:
    return {unit: i for i, (_, units) in enumerate(layers) for unit in units.split()}


def unit(module: str) -> str:
    """``stem.models.ffn`` -> ``stem.models``; ``stem.config`` -> ``stem.config``; ``stem`` -> ``stem``;
    ``workflow_scripts.train`` -> ``workflow_scripts``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "stem" else parts[0]


def _modules(packages=PACKAGES) -> dict[str, Path]:
    return {".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for package in packages for p in sorted(package.rglob("*.py"))}


@lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def entries(tree: ast.AST):
    """The registry entries written as ``"module:attr"`` strings in a parsed module: (node, module, attr)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := ENTRY.fullmatch(node.value)):
            yield node, m[1], m[2]


@lru_cache(maxsize=None)
def imports(packages=PACKAGES) -> list[tuple[str, str, str]]:
    """(importing module, imported module, 'file:line') for every import of the packages' modules anywhere in
    their source, function-level ones included (relative imports resolved; ``from stem import config`` names
    ``stem.config``), and for every ``"module:attr"`` string (a registry entry, imported on first use). Scanned once
    per package tuple for this file's tests: callers do not mutate the list."""
    mods = _modules(packages)
    top = {p.name for p in packages}
    out = []
    for name, path in mods.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        where = lambda node: f"{path.relative_to(packages[0].parent)}:{node.lineno}"  # noqa: E731
        tree = _tree(path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                out += [(name, a.name, where(node)) for a in node.names if a.name.split(".")[0] in top]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                if base.split(".")[0] not in top:
                    continue
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
                out += [(name, m, where(node)) for m in subs or [base]]
        out += [(name, module, where(node)) for node, module, _ in entries(tree)]
    return out


def top_names(path: Path) -> set[str]:
    """The names a module defines at its top (functions, classes, assignments, imports)."""
    names = set()
    for node in _tree(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def wrong_way(edges, layers=LAYERS) -> list[str]:
    """The imports that go up a layer, as 'file:line: A (layer) imports B (layer above)'."""
    rank = layer_of(layers)
    names = [n for n, _ in layers]
    bad = []
    for a, b, where in edges:
        ua, ub = unit(a), unit(b)
        if ua in rank and ub in rank and rank[ub] > rank[ua]:   # a unit without a layer: the next test
            bad.append(f"{where}: {a} ({names[rank[ua]]}) imports {b} ({names[rank[ub]]}, a layer above)")
    return bad


def unit_graph(edges) -> dict[str, set[str]]:
    graph = {}
    for a, b, _ in edges:
        graph.setdefault(unit(a), set())
        if unit(a) != unit(b):
            graph[unit(a)].add(unit(b))
    return graph


def test_the_checks_can_fail():
    toy = [("low", "stem.l"), ("high", "stem.h")]
    assert wrong_way([("stem.h.x", "stem.l.y", "stem/h/x.py:1")], toy) == []
    assert wrong_way([("stem.l.y", "stem.h.x", "stem/l/y.py:7")], toy) == [
        "stem/l/y.py:7: stem.l.y (low) imports stem.h.x (high, a layer above)"]
    assert _cycle(unit_graph([("stem.a.x", "stem.b.y", ""), ("stem.b.z", "stem.a.w", "")])) == [
        "stem.a", "stem.b", "stem.a"]
    # a cycle inside one package is the module-level test's business (tests/test_imports.py), not this one's
    assert _cycle(unit_graph([("stem.a.x", "stem.a.y", ""), ("stem.a.y", "stem.a.x", ""),
                              ("stem.a.x", "stem.b.y", "")])) is None


def test_the_scan_sees_lazy_and_relative_imports(tmp_path):
    pkg = tmp_path / "stem"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from . import mod\n")
    (pkg / "low" / "mod.py").write_text("def f():\n    from stem import top\n")
    (pkg / "top.py").write_text("from stem.low.mod import f\n")
    (pkg / "low" / "reg.py").write_text("ENTRIES = {'x': 'stem.top:Thing'}\n")     # a registry entry by name
    (tmp_path / "workflow_scripts").mkdir()
    (tmp_path / "workflow_scripts" / "job.py").write_text("def main():\n    from stem.top import f\n")
    assert sorted(imports((pkg, tmp_path / "workflow_scripts"))) == [
        ("stem.low", "stem.low.mod", "stem/low/__init__.py:1"), ("stem.low.mod", "stem.top", "stem/low/mod.py:2"),
        ("stem.low.reg", "stem.top", "stem/low/reg.py:1"), ("stem.top", "stem.low.mod", "stem/top.py:1"),
        ("workflow_scripts.job", "stem.top", "workflow_scripts/job.py:2")]
    toy = [("low", "stem stem.low"), ("top", "stem.top"), ("jobs", "workflow_scripts")]
    assert wrong_way(imports((pkg,)), toy) == [
        "stem/low/mod.py:2: stem.low.mod (low) imports stem.top (top, a layer above)",
        "stem/low/reg.py:1: stem.low.reg (low) imports stem.top (top, a layer above)"]


def test_registry_strings_name_a_module_and_a_defined_name():
    mods = _modules()
    found = [(node.value, f"{path.relative_to(REPO)}:{node.lineno}", mods.get(module), attr)
             for path in mods.values() for node, module, attr in entries(_tree(path))]
    assert {"stem.models.ffn:DenseFFN", "stem.eval.ppl:run_ppl", "stem.analysis.heaps:run"} <= {f[0] for f in found}
    bad = [f"{where}: {value!r}" for value, where, path, attr in found if path is None or attr not in top_names(path)]
    assert not bad, "registry entries naming no module of the tree or no name defined at its top:\n" + "\n".join(bad)


def test_the_design_doc_shows_the_layers():
    rows = re.findall(r"^\| ([a-z ]+) \| (`.*`) \|$", (REPO / "docs" / "design.md").read_text(), re.M)
    assert [(name, " ".join(re.findall(r"`([\w.]+)`", units))) for name, units in rows] == LAYERS
    assert f"{len(LAYERS)} layers" in __doc__


def test_every_package_and_module_has_a_layer():
    missing = sorted({unit(m) for m in _modules()} - set(layer_of()))
    assert not missing, f"add to tests/test_layers.py LAYERS (and docs/design.md): {', '.join(missing)}"


def test_imports_go_down_the_layers():
    bad = wrong_way(imports())
    assert not bad, "imports against the layers (tests/test_layers.py LAYERS):\n" + "\n".join(bad)


def test_no_package_level_import_cycle():
    assert _cycle(unit_graph(imports())) is None



# ---- function length (issue 28 item 6) -----------------------------------------------------------------
MAX_FUNCTION_LINES = 59   # def line to last line
LENGTH_CHECKED = ("stem", "workflow_scripts", "scripts")


def long_functions(paths, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``file:line name (N lines)`` for each function of ``paths`` (methods and nested ones too) over ``limit``."""
    out = []
    for path in paths:
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    out.append(f"{path}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_the_length_check_can_fail(tmp_path):
    for n in (59, 60):   # a method of n lines
        (tmp_path / f"toy{n}.py").write_text("class C:\n    def f(self):\n" + "        x = 1\n" * (n - 2)
                                             + "        return x\n")
    assert long_functions([tmp_path / "toy59.py"]) == []
    assert long_functions([tmp_path / "toy60.py"]) == [f"{tmp_path / 'toy60.py'}:2 f (60 lines)"]


def test_no_function_is_longer_than_59_lines():
    paths = [p for folder in LENGTH_CHECKED for p in sorted((REPO / folder).rglob("*.py"))]
    assert len(paths) > 100 and long_functions(paths) == []
