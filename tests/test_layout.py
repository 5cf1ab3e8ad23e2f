"""stem.layout holds every path of the workflow: the rules and the code name none themselves, and the paths are
the ones the workflow has always written (a moved path would orphan every existing result)."""
import ast
import re
from pathlib import Path

from stem import layout as L

REPO = Path(__file__).resolve().parents[1]
GENERATED = r"(?:results|reports|logs|data)/"
# Still written by hand in stem/__main__.py (its CLI defaults), which another branch is splitting (issue 28 item 6):
# they move to stem.layout there, and the test then says to drop them from this list.
PENDING = {("stem/__main__.py", "results/tiny/350m/stem/pretrain/checkpoint"),
           ("stem/__main__.py", "data/rehearsal/hub")}


def test_the_rules_name_no_path_of_their_own():
    for smk in sorted((REPO / "rules").glob("*.smk")) + [REPO / "Snakefile"]:
        code = "\n".join(line.split("#")[0] for line in smk.read_text().splitlines())  # comments may show paths
        literal = re.findall(rf"""["']{GENERATED}[^"']*["']""", code)
        assert not literal, f"{smk.name}: literal paths {literal} (add them to stem/layout.py)"


def literal_paths(source: str) -> list[str]:
    """The strings of Python source that begin with a generated path (an f-string's first part too); docstrings
    and comments may show paths."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs and re.match(GENERATED, n.value)]


def test_the_code_names_no_path_of_its_own():
    toy = '"""data/x"""\ndef f(e):\n    """logs/y"""\n    return f"reports/{e}/z", "results/w"  # logs/\n'
    assert sorted(literal_paths(toy)) == ["reports/", "results/w"]
    files = [p for d in ("stem", "workflow_scripts") for p in sorted((REPO / d).rglob("*.py"))]
    found = {(str(p.relative_to(REPO)), s) for p in files if p != REPO / "stem" / "layout.py"
             for s in literal_paths(p.read_text())}
    assert not found - PENDING, f"literal paths {sorted(found - PENDING)} (add them to stem/layout.py)"
    assert not PENDING - found, f"no longer written by hand: {sorted(PENDING - found)} (drop them from PENDING)"


def test_report_paths():
    e = "{experiment}"
    assert [L.params_file(e, x) for x in L.PARAMS_FILES] == ["reports/{experiment}/params.csv",
                                                              "reports/{experiment}/params.md"]
    assert L.table_file(e, "table3", "tex") == "reports/{experiment}/tables/table3.tex"
    assert L.reproduced(e) == "reports/{experiment}/tables/reproduced.csv"
    assert [L.diff_file(e, f) for f in L.DIFF_FILES] == [
        f"reports/{{experiment}}/diff/{f}" for f in ("diff.md", "cells.csv", "directions.csv",
                                                     "paper_consistency.csv", "summary.json")]
    assert L.figure_file(e, "{figure}", "png") == "reports/{experiment}/figures/{figure}.png"
    assert (L.report_readme(e), L.report_html(e)) == ("reports/{experiment}/README.md", "reports/{experiment}/report.html")
    assert L.offload_file(e, "json") == "reports/{experiment}/offload/offload.json"
    assert L.offload_file(e, "md", "{variant}") == "reports/{experiment}/offload/{variant}/offload.md"
    assert L.sweep_file(e, "rho", "pdf") == "reports/{experiment}/sweeps/rho.pdf"


def test_log_paths():
    assert L.experiment_log("tiny", "report_figure_{figure}") == "logs/tiny/report_figure_{figure}.log"
    assert L.corpus_log("tiny", "web") == "logs/tiny/corpus/web.log"
    assert L.tokenizer_log("tiny", "1b") == "logs/tiny/1b/tokenizer.log"
    assert L.tokenize_log("tiny", "1b", "web", "part00000-of-00002") == "logs/tiny/1b/tokenize/web/part00000-of-00002.log"
    assert L.tokens_gather_log("tiny", "1b", "web") == "logs/tiny/1b/tokenize/web/gather.log"
    assert L.fixtures_log("tiny") == "logs/tiny/eval/fixtures.log"
    assert L.export_hf_log(*L.STAGE) == "logs/{experiment}/{scale}/{variant}/{stage}/export_hf.log"
