"""Nothing wrong passes silently (issue 16): config cross-references checked before any job runs."""
import copy

import pytest

from stem import config as C

KNOWN = "expected one of ['bios_n0032', 'code', 'long', 'math', 'web']"


@pytest.fixture(scope="module")
def tiny_raw():
    return C.read_yaml(C.REPO / "config" / "tiny.yaml")


@pytest.mark.parametrize("key, edit", [
    ("stages.midtrain.1b.data", lambda c: c["stages"]["midtrain"]["1b"].update(data={"web": 0.5, "wiki": 0.5})),
    # a stage the matrix does not run yet is still checked
    ("stages.midtrain.350m.data", lambda c: c["stages"]["midtrain"].update(
        {"350m": {**c["stages"]["midtrain"]["1b"], "data": {"wiki": 1.0}}})),
    ("tokenizer.1b.sources", lambda c: c["tokenizer"]["1b"].update(sources=["web", "wiki"])),
    ("eval.suites.niah.haystack", lambda c: c["eval"]["suites"]["niah"].update(haystack="wiki")),
    ("eval.suites.ppl.source", lambda c: (c["eval"]["suites"]["ppl"].update(source="wiki"),
                                          c["eval"]["stages"]["pretrain"].append("ppl"))),
])
def test_unknown_source_name_is_one_line_naming_the_key(tiny_raw, key, edit):
    """Issue 16.8: today an eval suite's unknown source is `KeyError: 'wiki'` when its job spec is built."""
    cfg = copy.deepcopy(tiny_raw)
    edit(cfg)
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(cfg, origin="tiny.yaml")
    assert str(e.value) == f"tiny.yaml: key '{key}': unknown source 'wiki'; {KNOWN}"


def test_known_sources_pass(tiny_raw):
    C.experiment.parse(copy.deepcopy(tiny_raw), origin="tiny.yaml")
    C.experiment.load(C.REPO / "config" / "paper.yaml")
    cfg = copy.deepcopy(tiny_raw)  # a suite no stage of the matrix runs may name a source the config dropped
    cfg["eval"]["suites"]["ppl"]["source"] = "wiki"
    C.experiment.parse(cfg, origin="tiny.yaml")
