"""Numbers the docs quote from a config are the config's (issue 39 item 5: docs/training.md said the tiny run has
80 pretraining steps while config/tiny.yaml had 70). Each entry: a file, a pattern whose groups are the quoted
numbers, and the values they must be, read from the config the text talks about."""
import math
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
TINY = yaml.safe_load((REPO / "config" / "tiny.yaml").read_text())
PRE, ARCHS = TINY["stages"]["pretrain"], TINY["archs"]
KN_STAGE = yaml.safe_load((REPO / "config" / "knowledge.yaml").read_text())["stages"]["pretrain"]["350m"]


QUOTED = [
    ("docs/training.md", r"measured when the tiny\s+pretraining had 200 steps, it has (\d+) now",
     lambda: [PRE["350m"]["steps"]]),
    ("docs/confidence.md", r"the tiny STEM-dagger model trains (\d+) steps", lambda: [PRE["350m"]["steps"]]),
    ("docs/evaluation.md", r"after (\d+) steps of context extension", lambda: [TINY["stages"]["extend"]["1b"]["steps"]]),
    ("docs/training.md", r"fetch ([\d.]+) \+ accumulation\s+([\d.]+) B a fetched parameter, clipping ([\d.]+) and update "
     r"\+ zeroing ([\d.]+) B a touched parameter, replay ([\d.]+) B a replayed parameter-step", lambda: _host_bytes()),
    ("docs/knowledge.md", r"The stage now trains batch (\d+) x (\d+) tokens at lr ([\d.e-]+)\.",
     lambda: [KN_STAGE["batch_size"], KN_STAGE["seq_len"], f"{KN_STAGE['lr']:.1e}".replace("e-0", "e-")]),
    ("config/accepted/tiny.yaml", r"experiment tiny: (\d+) pretraining steps of d=(\d+) \(350m\) or d=(\d+) \(1b\)",
     lambda: [PRE["350m"]["steps"], ARCHS["350m"]["d_model"], ARCHS["1b"]["d_model"]]),
    ("docs/knowledge.md", r"source `bios_n0032` \(N (\d+) individuals with one-token names, E (\d+) exposures each",
     lambda: [TINY["sources"]["bios_n0032"][k] for k in ("n", "exposures")]),
    ("docs/knowledge.md", r"d (\d+), (\d+) layers, STEM at layers 2 and 5; `knowledge.vocab_size` (\d+) for its own "
     r"(\d+)-token BPE \+ the (\d+)\s+names\), one seed, one pass \((\d+) steps of (\d+) x (\d+) tokens",
     lambda: [ARCHS["350m"]["d_model"], ARCHS["350m"]["n_layers"], TINY["knowledge"]["vocab_size"],
              TINY["knowledge"]["tokenizer"]["vocab_size"], TINY["knowledge"]["names"], _knowledge_steps(),
              TINY["knowledge"]["train"]["batch_size"], TINY["knowledge"]["train"]["seq_len"]]),
]


def _knowledge_steps() -> int:
    """One pass over tiny's reduced knowledge world (stem.knowledge.steps, by hand: N x E x tokens_per_bio tokens)."""
    kn, src = TINY["knowledge"], TINY["sources"]["bios_n0032"]
    return math.ceil(src["n"] * src["exposures"] * kn["tokens_per_bio"] / (kn["train"]["batch_size"] * kn["train"]["seq_len"]))


def _host_bytes() -> list:
    """stem.train.comms.HOST_BYTES_PER_PARAM as docs/training.md quotes them (read from the source: no torch here)."""
    text = (REPO / "stem" / "train" / "comms.py").read_text()
    found = re.search(r'HOST_BYTES_PER_PARAM = \{"fetch": ([\d.]+), "accumulate": ([\d.]+), "clip": ([\d.]+), '
                      r'"update": ([\d.]+), "replay": ([\d.]+)\}', text)
    return list(found.groups())


@pytest.mark.parametrize("path, pattern, expected", QUOTED, ids=[q[0] + ":" + q[1][:30] for q in QUOTED])
def test_numbers_quoted_from_the_config_are_the_configs(path, pattern, expected):
    text = re.sub(r"\s+", " ", (REPO / path).read_text())
    found = re.findall(pattern.replace(r"\s+", " "), text)
    assert found, f"{path}: no text matching {pattern!r} (reworded? update this test)"
    want = [str(x) for x in expected()]
    for groups in found:
        groups = [groups] if isinstance(groups, str) else list(groups)
        assert groups == want, f"{path}: quotes {groups} where the config has {want}"


def test_the_reduced_gate_dag_steps_in_confidence_md(tmp_path):
    import test_workflow
    cfg = yaml.safe_load(test_workflow._reduced_config(tmp_path).read_text())
    steps = {spec["steps"] for stage in cfg["stages"].values() for spec in stage.values()}
    text = re.sub(r"\s+", " ", (REPO / "docs" / "confidence.md").read_text())
    assert re.findall(r"a reduced tiny DAG \(d_model (\d+), (\d+) steps a job\)", text) == [
        (str(cfg["archs"]["350m"]["d_model"]), str(steps.pop()))] and not steps
