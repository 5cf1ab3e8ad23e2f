"""A variant is defined once, in config/variants.yaml (issue 20 item 1): its label and colour reach the config
check, the tables and the figures from there; adding one touches that file and an experiment's matrix only."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stem import config as C  # noqa: E402
from stem.config import experiment  # noqa: E402
from stem import io as stem_io  # noqa: E402
from stem.registry import FFN_KINDS  # noqa: E402
from stem.report import build as B  # noqa: E402
from stem.report import diff  # noqa: E402
from stem.report import figures as F  # noqa: E402
from stem.report import tables as T  # noqa: E402
from stem.report.results import Results  # noqa: E402

NEW = "stem_quarter:  {label: STEM-1/4, ffn: stem, placement: {every: 4, offset: 3}, color: \"#123456\"}\n"


def test_a_new_variant_in_variants_yaml_is_labelled_and_coloured_everywhere(tmp_path, monkeypatch):
    path = tmp_path / "variants.yaml"
    path.write_text((REPO / "config" / "variants.yaml").read_text() + NEW)
    monkeypatch.setattr(stem_io, "VARIANTS", path)
    cfg = C.read_yaml(REPO / "config" / "tiny.yaml")
    cfg["matrix"]["350m"]["variants"].append("stem_quarter")   # the matrix line
    exp = experiment.parse(cfg, origin="tiny.yaml")              # the config check accepts it
    assert ("350m", "stem_quarter", "pretrain") in C.train_targets(exp)
    assert C.model_config_for(exp, "350m", "stem_quarter").ffn[3] == "stem"
    assert C.variant_labels(exp)["stem_quarter"] == T.row_labels(exp, "table3")["stem_quarter"] == "STEM-1/4"
    one = T.frame([T.cell("table3", "350m", "stem_quarter", "avg", 1.0)])
    assert T.labelled(one, exp)["row"].tolist() == ["STEM-1/4"]
    assert (F.legend_label(exp, "stem_quarter"), F.color(exp, "stem_quarter")) == ("STEM-1/4", "#123456")
    assert T.ordered_variants(exp, ["stem_quarter", "moe", "dense"]) == ["dense", "moe", "stem_quarter"]


def test_labels_and_colours_are_the_reports_of_before():
    """The report's labels and colours, as the Python modules listed them before they moved to variants.yaml."""
    assert C.variant_labels() == {
        "dense": "Baseline", "hashmoe": "Hash-MoE", "stem": "STEM", "stem_gate": "STEM (gate-proj)",
        "stem_dagger": "STEM†", "stem_half": "STEM-1/2", "stem_full": "STEM-full",
        "stem_sparse": "STEM (sparse update)", "stem_insert": "STEM (mid-training insertion)", "moe": "MoE",
        "dse": "DSE (Cheng et al.)"}
    assert C.variant_colors() == {"dense": "#4d4d4d", "hashmoe": "#d62728", "stem": "#1f77b4", "stem_gate": "#9467bd",
                        "stem_dagger": "#8c564b", "stem_half": "#2ca02c", "stem_full": "#ff7f0e",
                        "stem_sparse": "#e377c2", "dse": "#17becf"}
    assert C.variant_figure_labels() == {**C.variant_labels(), "stem": "STEM (1/3)"}
    assert C.baseline_variant() == "dense"


def test_no_python_file_lists_the_variants_labels_or_colours():
    """No {variant: label} or {variant: colour} table in Python, no label as a string (the plain-word labels
    STEM, MoE aside), no variant named in the config's typed tree."""
    variants = yaml.safe_load((REPO / "config" / "variants.yaml").read_text())
    for py in (REPO / "stem").rglob("*.py"):
        text = py.read_text()
        for name, spec in variants.items():
            values = "|".join(re.escape(spec[k]) for k in ("label", "color", "figure_label") if spec.get(k))
            assert not re.search(rf"[\"']{name}[\"']\s*:\s*[\"']({values})[\"']", text), f"{py.relative_to(REPO)}: {name}"
            if len(spec["label"]) > 4:
                assert not re.search(rf"[\"']{re.escape(spec['label'])}[\"']", text), f"{py.relative_to(REPO)}: {name}"
    tree = (REPO / "stem" / "config" / "experiment.py").read_text()
    for line in tree.splitlines():   # a list of the variants (an enum, a pattern) would name several on a line
        assert len([n for n in variants if re.search(rf"\b{n}\b", line)]) < 3, line


def test_the_docs_variant_table_is_variants_yaml():
    """docs/variants.md's table is generated from config/variants.yaml (scripts/variants_table.py): it fails when
    the two drift; every FFN kind (registered or used by a variant) has its equation in the kinds table."""
    spec = importlib.util.spec_from_file_location("variants_table", REPO / "scripts" / "variants_table.py")
    vt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vt)
    doc = vt.DOC.read_text()
    variants = stem_io.variants_file()
    assert vt.with_table(doc, variants) == doc, "docs/variants.md: run python scripts/variants_table.py"
    new = vt.with_table(doc, {**variants, **yaml.safe_load(NEW)})
    assert "| `stem_quarter` | STEM-1/4 | `stem` | every 4th from 3 | - |" in new
    kinds_table = doc.split("| FFN kind | FFN of a layer |")[1].split("\n\n")[0]
    kinds = set(re.findall(r"^\| `(\w+)` \|", kinds_table, re.M))
    assert set(FFN_KINDS) | {v["ffn"] for v in variants.values()} <= kinds, sorted(kinds)


def test_a_variant_overrides_label_and_colour_reach_the_report(tmp_path):
    """A config's ``variant_overrides`` label, figure label and colour are what its report prints (tables, diff,
    figures), not config/variants.yaml's (issue 28 item 2: the report read the file's, frozen at import)."""
    cfg = C.read_yaml(REPO / "config" / "tiny.yaml")
    cfg["matrix"] = {"1b": {"variants": ["dense", "stem"], "stages": ["midtrain"]}}   # Table 4's rows, no Table 3
    del cfg["stages"]["midtrain"]["1b"]["init_from"]   # a first stage of its matrix entry
    cfg["variant_overrides"] = {"stem": {"label": "STEM, overridden", "figure_label": "STEM 1/3, overridden",
                                         "color": "#010203"}}
    exp = experiment.parse(cfg)
    res = Results(exp.experiment, tmp_path)   # no results yet: every cell a gap, every row still labelled
    ours = T.build_all(exp, res)
    assert T.wide(ours["table4"])["Model"].tolist() == ["Baseline", "STEM, overridden"]
    md = diff.render(exp, *B.run_diff(exp, ours)[:4])
    assert "| 1b | STEM, overridden |" in md and "| STEM |" not in md
    fig = F.draw("fig1a_val_ppl_vs_tokens", exp, res, ours)
    assert "STEM 1/3, overridden" in fig.axes[0].texts[0].get_text()
    assert F.color(exp, "stem") == "#010203" and F.color(None, "stem") == "#1f77b4"


def test_one_baseline():
    """The baseline is named once (variants.yaml's ``baseline: true``); a config whose overrides make two is one line."""
    cfg = C.read_yaml(REPO / "config" / "tiny.yaml")
    assert C.baseline_variant(C.experiment.parse(cfg, "tiny.yaml")) == "dense"
    cfg["variant_overrides"] = {"stem": {"baseline": True}}
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(cfg, origin="tiny.yaml")
    assert str(e.value) == ("tiny.yaml: key 'baseline': expected exactly one variant with baseline: true in "
                            "config/variants.yaml and variant_overrides (the report's baseline), found dense, stem")
    cfg["variant_overrides"] = {"stem": {"baseline": True}, "dense": {"baseline": False}}
    assert C.baseline_variant(C.experiment.parse(cfg, "tiny.yaml")) == "stem"
