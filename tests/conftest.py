"""Shared fixtures: a small real dataset (synthetic world -> BPE -> token shards) built once per session."""
import copy
import json
from pathlib import Path

import pytest

from stem import config as C
from stem.pipeline import make_corpus, make_tokenizer, tokenize

SOURCES = {"web": 150_000, "math": 40_000, "long": 120_000}

# The slowest test files, slowest first (`pytest --durations`, session 11, whole file): pytest-xdist's loadfile
# hands files to its workers in collection order, so a long file collected last is the suite's tail.
SLOW_FIRST = ["test_workflow.py", "test_paper_data_path.py", "test_memory.py", "test_real.py", "test_tables.py",
              "test_distributed.py"]


def pytest_collection_modifyitems(items):
    """The files of SLOW_FIRST first, in its order; every file's tests keep their order."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOW_FIRST)))


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """{'tokenizer': path, 'manifests': {source: manifest path}} for web, math and long documents."""
    root = tmp_path_factory.mktemp("tiny_data")
    world = {"seed": 7, "n_countries": 20, "n_people": 60, "n_filler": 500}
    corpora = {}
    for src, n in SOURCES.items():
        spec = {"generator": src, "bytes": n, "seed": 1, "world": world}
        if src == "long":
            spec.update(min_chars=1500, max_chars=4000)
        corpora[src] = root / f"{src}.jsonl"
        make_corpus(spec, corpora[src])
    tok_path = root / "tokenizer.json"
    make_tokenizer({"kind": "train_bpe", "vocab_size": 512,
                    "documents": [{"kind": "files", "paths": [str(corpora["web"])], "format": "jsonl"}]}, tok_path)
    manifests = {}
    for src, path in corpora.items():
        out = root / "tokens" / src
        tokenize({"documents": {"kind": "files", "paths": [str(path)], "format": "jsonl"}, "seed": 0,
                  "vocab_size": 512, "max_tokens": None}, tok_path, out, workers=1)
        manifests[src] = str(out / "manifest.json")
    return {"tokenizer": str(tok_path), "manifests": manifests, "root": root}


def checked_yaml(path) -> dict:
    """A config file's mapping as written, for tests that reshape or compare it, after the whole check
    (stem.config.experiment.load: the pipeline itself reads only the typed tree)."""
    C.experiment.load(path)
    return C.read_yaml(path)


def reshaped(cfg: dict, origin: str = "tiny.yaml (reshaped by a test)"):
    """A config mapping a test reshaped (smaller archs, other overrides) as its typed tree: each train_bpe tokenizer
    sized to its scale's vocabulary (a pretrained stand-in below BPE's 260: the test's ids are random), each stage's
    sequences cut to its model's context, the sweeps (sized for the config's own archs) left out."""
    cfg = {k: copy.deepcopy(v) for k, v in cfg.items() if k != "sweeps"}
    for scale, arch in cfg["archs"].items():
        for stage in cfg["stages"].values():
            if scale in stage:
                st = stage[scale]
                st["seq_len"] = min(st["seq_len"], st.get("max_seq_len") or arch["max_seq_len"])
    for scale, tok in cfg["tokenizer"].items():
        vocab = cfg["archs"].get(scale, {}).get("vocab_size", tok.get("vocab_size", 0))
        if tok.get("vocab_size", 0) > vocab:
            cfg["tokenizer"][scale] = {**tok, "vocab_size": vocab} if vocab >= 260 else {"kind": "pretrained",
                                                                                         "path": "none (random ids)"}
    return C.experiment.parse(cfg, origin)


def make_spec(tiny_data, out_dir, variant="stem", stage="pretrain", data=None, **train):
    """A training job spec on the tiny dataset: small model, few steps; ``train`` overrides."""
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["archs"]["350m"].update(vocab_size=512, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=48,
                                max_seq_len=256)
    cfg["tokenizer"]["350m"]["vocab_size"] = 512
    cfg["variant_overrides"] = {"hashmoe": {"n_experts": 4}, "moe": {"moe_experts": 4, "moe_d_ff": 24}, "dse": {"dse": {"rows_per_head": 101, "d_mem": 16, "heads": 2}}}
    spec = C.train_spec(reshaped(cfg), "350m", variant, "pretrain")
    spec["stage"] = stage
    spec["train"].update(batch_size=4, micro_batch=2, seq_len=32, steps=12, warmup=0.1, lr=3e-3,
                         eval_interval=6, eval_batches=2, checkpoint_interval=4, log_interval=100)
    spec["train"].update(train)
    data = data or {"web": 1.0}
    spec["data"] = {s: {"weight": w, "manifest": tiny_data["manifests"][s]} for s, w in data.items()}
    spec["tokenizer"] = tiny_data["tokenizer"]
    spec["out_dir"] = str(out_dir)
    return json.loads(json.dumps(spec))


@pytest.fixture
def spec_factory(tiny_data):
    return lambda out_dir, **kw: make_spec(tiny_data, Path(out_dir), **kw)


def job_counts(stdout: str) -> dict:
    """Parse the 'Job stats' table of a dry run."""
    lines = stdout.split("Job stats:")[1].splitlines()[3:]
    counts = {}
    for line in lines:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        counts[parts[0]] = int(parts[1])
    return counts
