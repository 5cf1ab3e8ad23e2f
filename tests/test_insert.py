"""Mid-training insertion of STEM into a dense checkpoint (stem.models.insert; variant stem_insert): the tables
are the formula, every other weight is the dense source's bit for bit, the stage resumes after SIGKILL."""
import copy
import json

import numpy as np
import pytest
import torch

from stem import config as C
from stem.models.model import build_model
from stem.optim import Group
from stem.specs import TrainSpec
from stem.checkpoint import save_checkpoint
from stem.train.loop import setup, train
from stem.train.step import TrainingError

from killing import sigkill_after_state


@pytest.fixture
def dense_ckpt(spec_factory, tmp_path):
    """A random dense model saved as the tiny data's 350m dense pretrain checkpoint (norm weights away from 1)."""
    spec = spec_factory(tmp_path / "dense", variant="dense")
    torch.manual_seed(11)
    model = build_model(TrainSpec.coerce(spec).model)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    save_checkpoint(tmp_path / "dense" / "checkpoint", model, spec, spec["tokenizer"], {})
    return tmp_path / "dense" / "checkpoint", model.state_dict()


def insert_spec(spec_factory, out, ckpt, init="projected", **train):
    spec = spec_factory(out, variant="stem", stage="midtrain", **train)
    spec.update(init_from=str(ckpt), init_stage="pretrain", insert={"from": "dense", "init": init})
    return spec


@pytest.mark.parametrize("init", ["projected", "raw"])
def test_tables_are_the_projection_and_the_rest_is_copied(init, spec_factory, dense_ckpt, tmp_path):
    ckpt, dense = dense_ckpt
    model = setup(TrainSpec.coerce(insert_spec(spec_factory, tmp_path / "ins", ckpt, init=init))).model
    cfg, state = model.cfg, model.state_dict()
    layers = [i for i, k in enumerate(cfg.ffn) if k == "stem"]
    assert layers == [2]
    e = dense["tok_emb.weight"].double().numpy()
    for i in layers:   # U_i[t] = (E[t] / sqrt(mean(E[t]^2) + eps) * g_i) W_up,i^T (raw: E[t] W_up,i^T), in numpy
        g = dense[f"layers.{i}.ffn_norm.weight"].double().numpy()
        w_up = dense[f"layers.{i}.ffn.w_up.weight"].double().numpy()
        normed = e / np.sqrt((e ** 2).mean(axis=1, keepdims=True) + cfg.norm_eps) * g
        want = (normed if init == "projected" else e) @ w_up.T
        got = state[f"layers.{i}.ffn.table.weight"].double().numpy()
        assert got.shape == (cfg.vocab_size, cfg.d_ff)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        assert f"layers.{i}.ffn.w_up.weight" not in state
    for k, v in state.items():   # every other tensor: the dense source, bit for bit
        if ".ffn.table." not in k:
            assert torch.equal(v, dense[k]), k
    assert set(dense) - set(state) == {f"layers.{i}.ffn.w_up.weight" for i in layers}


def test_xavier_init_keeps_the_tables_own_init(spec_factory, dense_ckpt, tmp_path):
    ckpt, dense = dense_ckpt
    spec = TrainSpec.coerce(insert_spec(spec_factory, tmp_path / "ins", ckpt, init="xavier"))
    state = setup(spec).model.state_dict()
    torch.manual_seed(spec.seed)
    fresh = build_model(spec.model).state_dict()
    assert torch.equal(state["layers.2.ffn.table.weight"], fresh["layers.2.ffn.table.weight"])
    assert torch.equal(state["layers.2.ffn.w_gate.weight"], dense["layers.2.ffn.w_gate.weight"])


def test_calibrated_insertion_trains_from_the_calibration_of_its_train_split(spec_factory, dense_ckpt, tmp_path):
    """Init calibrated on the training path (stem.train.calibration): the job calibrates the tables on windows of
    the stage's train split (the same tables stem.models.calibrate gives on them), trains, and its summary records
    the calibration; a source tokenised with another tokenizer is one line naming calibration.manifest."""
    from stem.models.calibrate import calibrate
    from stem.train.calibration import calibration_windows
    ckpt, dense = dense_ckpt
    spec = insert_spec(spec_factory, tmp_path / "ins", ckpt, init="calibrated", steps=2, eval_interval=2)
    manifest = spec["data"]["web"]["manifest"]
    spec["insert"]["calibration"] = {"source": "web", "manifest": manifest, "tokens": 256, "unseen": "mean",
                                     "sequential": False}
    model = setup(TrainSpec.coerce(spec)).model
    ref = build_model(TrainSpec.coerce(spec_factory(tmp_path / "d", variant="dense")).model).eval()
    ref.load_state_dict(dense)
    x = calibration_windows(manifest, manifest, 256, 32, ref.cfg.vocab_size)
    want = calibrate(ref, x, [2], log=lambda m: None).table(2, torch.arange(ref.cfg.vocab_size), dense)
    torch.testing.assert_close(model.state_dict()["layers.2.ffn.table.weight"], want)
    rec = train(spec, threads=1)["insertion"]
    assert rec["tokens"] == 256 and rec["rows_calibrated"] == len(x.unique()) and rec["stem_layers"] == [2]
    assert 0 < rec["heldout_coverage"] <= 1 and rec["memory_bound_bytes"] == 128 * 48 * 8
    other = tmp_path / "other" / "manifest.json"
    other.parent.mkdir()
    other.write_text(json.dumps({**json.loads(open(manifest).read()), "tokenizer_sha256": "0" * 64}))
    spec = insert_spec(spec_factory, tmp_path / "ins2", ckpt, init="calibrated", steps=2)
    spec["insert"]["calibration"] = {"source": "other", "manifest": str(other), "tokens": 256}
    with pytest.raises(TrainingError, match=r"calibration.manifest: .*other/manifest.json: tokenizer_sha256 '0+', "
                                            r"expected '[0-9a-f]+'"):
        train(spec, threads=1)
    assert not (tmp_path / "ins2" / "summary.json").exists()


def test_entity_texts_are_seeded_and_calibrate_the_entities_rows(spec_factory, dense_ckpt, tmp_path):
    """insert.calibration.entities (stem.train.entity_text): the dense checkpoint writes ``new_tokens`` sampled
    tokens after every prompt for every entity, ``samples`` times, the same ids for the same seed and never EOS; the
    insertion's calibration reads them beside its windows and records that every entity's row is calibrated."""
    from stem.data.tokenizer import load_tokenizer
    from stem.train.calibration import calibrate_insertion
    from stem.train.entity_text import generate
    ckpt, dense = dense_ckpt
    facts = tmp_path / "facts.yaml"
    facts.write_text("kinds:\n  place:\n    templates: {capital: 'The capital of {e} is'}\n"
                     "    entities: {Zorland: {capital: ' Zed'}, Quux: {capital: ' Q'}}\n")
    ent = {"facts": str(facts), "prompts": ["About {e}.", "The {e} story of"], "new_tokens": 3, "samples": 2,
           "seed": 3, "temperature": 1.0}
    rec = generate(ckpt, ent, tmp_path / "a.json")
    assert generate(ckpt, ent, tmp_path / "b.json")["texts"] == rec["texts"]
    eos = load_tokenizer(ckpt / "tokenizer.json").eos_id
    assert len(rec["texts"]) == 2 * 2 * 2 and rec["tokens"] == sum(t["prompt_tokens"] + 3 for t in rec["texts"])
    assert all(eos not in t["ids"][t["prompt_tokens"]:] for t in rec["texts"])
    spec = insert_spec(spec_factory, tmp_path / "ins", ckpt, init="calibrated")
    manifest = spec["data"]["web"]["manifest"]
    cal = spec["insert"]["calibration"] = {"source": "web", "manifest": manifest, "tokens": 64, "unseen": "mean",
                                           "sequential": False, "entities": {**ent, "out": str(tmp_path / "a.json")}}
    _, out = calibrate_insertion(TrainSpec.coerce(spec).model, dense, cal, manifest, 32, log=lambda m: None)
    assert out["entities"]["entities"] == 2 and out["entities"]["entity_rows_calibrated"] == 2
    assert out["rows_calibrated"] >= out["entities"]["rows_added"] and out["entities"]["texts_tokens"] == rec["tokens"]


def test_insertion_refuses_a_non_dense_source(spec_factory, dense_ckpt, tmp_path):
    ckpt, _ = dense_ckpt
    spec = json.loads((ckpt / "config.json").read_text())
    spec["variant"] = "stem"
    (ckpt / "config.json").write_text(json.dumps(spec))
    with pytest.raises(TrainingError, match=r"config.json: init_from checkpoint has variant 'stem', expected 'dense'"):
        train(insert_spec(spec_factory, tmp_path / "ins", ckpt))


def test_insertion_stage_sigkill_then_rerun_ends_with_the_same_loss(spec_factory, dense_ckpt, tmp_path):
    ckpt, _ = dense_ckpt
    full = train(insert_spec(spec_factory, tmp_path / "full", ckpt, steps=12, checkpoint_interval=4), threads=1)
    killed = insert_spec(spec_factory, tmp_path / "killed", ckpt, steps=12, checkpoint_interval=4)
    sigkill_after_state(killed, 4)
    resumed = train(killed, threads=1)
    assert resumed["last_step_loss"] == full["last_step_loss"]
    assert resumed["final_val_loss"] == full["final_val_loss"]


def test_stem_insert_variant_and_stage_table_group():
    raw = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg = C.experiment.parse(raw, "tiny.yaml")
    targets = C.train_targets(cfg)
    assert ("1b", "stem_insert", "midtrain") in targets and ("1b", "stem_insert", "pretrain") not in targets
    spec = C.train_spec(cfg, "1b", "stem_insert", "midtrain")
    assert spec["init_from"] == "results/tiny/1b/dense/pretrain/checkpoint" and spec["init_stage"] == "pretrain"
    assert spec["insert"] == {"from": "dense", "init": "projected"}
    assert spec["model"] == C.train_spec(cfg, "1b", "stem", "midtrain")["model"]
    ext = C.train_spec(cfg, "1b", "stem_insert", "extend")
    assert ext["init_from"] == "results/tiny/1b/stem_insert/midtrain/checkpoint" and "insert" not in ext
    with pytest.raises(C.ConfigError, match="has no 'pretrain' stage of its own"):
        C.train_spec(cfg, "1b", "stem_insert", "pretrain")
    # the table group's LR and weight decay per stage (the official insertion config: 5e-4 over 1e-5, no decay)
    cfg2 = copy.deepcopy(raw)
    cfg2["stages"]["midtrain"]["1b"]["table_group"] = {"lr_mult": 50, "weight_decay": 0.0}
    cfg2 = C.experiment.parse(cfg2, "tiny.yaml (a table group)")
    spec = C.train_job(cfg2, "1b", "stem_insert", "midtrain")
    assert spec.optim.groups["table"] == Group(lr_mult=50, weight_decay=0.0)
    from stem.optim import build_optimizer
    opt = build_optimizer(build_model(spec.model, "meta"), spec.to_dict()["optim"], 1e-5)
    table = next(g for g in opt.param_groups if g["name"] == "table")
    assert table["lr"] == pytest.approx(5e-4) and table["weight_decay"] == 0.0
    assert next(g for g in opt.param_groups if g["name"] == "matrix")["lr"] == pytest.approx(1e-5)
    # other stages keep the experiment's table group
    assert C.train_spec(cfg2, "1b", "stem", "pretrain")["optim"] == C.train_spec(cfg, "1b", "stem", "pretrain")["optim"]


def test_official_configs_are_rows_of_the_paper_audit():
    from stem.report import diff
    cons = diff.paper_consistency()
    off = cons[cons["table"] == "official_code"].set_index(["scale", "variant", "column"])
    assert len(off) == len(diff.official_configs()) == 18
    row = off.loc[("1b", "stem_insert", "table_lr")]
    assert row["printed"] == 3.2e-4 and row["recomputed"] == 5e-4 and not row["consistent"]
    assert "stem_llama3_1B.yaml (128c2760fae0ea5ce3484eb01caca241dfa5d521; " in row["note"] and "stem_lr: 5e-4" in row["note"]
    assert off.loc[("350m", "stem", "warmup_ratio"), "recomputed"] == 0.005   # 2000 of 400k steps
    assert (diff.official_configs()["commit"].str.len() == 40).all()
    assert off.loc[("350m", "stem", "n_stem_layers"), "recomputed"] == 13
    assert off.loc[("350m", "stem", "peak_lr"), "consistent"]   # the same 2e-3
    assert off["check"].str.startswith("Official code config stem_").all()   # diff.md lists the inconsistent ones


def _docs_block(name):
    import re

    import yaml
    text = (C.REPO / "docs" / "huggingface.md").read_text()
    m = re.search(rf"<!-- {name} -->\n```yaml\n(.*?)```", text, re.S)
    return yaml.safe_load(m.group(1))


def test_official_blocks_in_the_docs():
    """The documented config blocks run the official settings: merged over config/paper.yaml, they validate and
    give the official values in the job specs (no code change)."""
    from stem.io import deep_merge
    paper = C.read_yaml(C.REPO / "config" / "paper.yaml")
    cfg = C.experiment.parse(deep_merge(copy.deepcopy(paper), _docs_block("official-1b")))
    assert C.train_targets(cfg)[-1] == ("1b", "stem_insert", "pretrain")
    job = C.train_job(cfg, "1b", "stem_insert", "pretrain")
    assert job.init_from == "hf:meta-llama/Llama-3.2-1B" and job.insert == {"from": "dense", "init": "projected"}
    assert [i for i, k in enumerate(job.model.ffn) if k == "stem"] == [2, 6, 10, 14]
    assert (job.train.lr, job.train.steps, job.train.seq_len, job.optim.weight_decay) == (1e-5, 60000, 4096, 0.033)
    assert job.optim.groups["table"] == Group(lr_mult=50, weight_decay=0.0)   # 5e-4 = 50 x 1e-5, no decay
    assert (job.train.warmup, job.train.min_lr_ratio) == (0.0333, 1e-6)   # 2000 of 60k steps; lr_min_ratio
    cfg = C.experiment.parse(deep_merge(copy.deepcopy(paper), _docs_block("official-350m")))
    job = C.train_job(cfg, "350m", "stem", "pretrain")
    assert [i for i, k in enumerate(job.model.ffn) if k == "stem"] == list(range(2, 27, 2))   # 13 layers
    assert (job.train.seq_len, job.model.max_seq_len, job.train.steps) == (4096, 4096, 400000)
    assert (job.train.warmup, job.train.min_lr_ratio) == (0.005, 0.1)   # 2000 of 400k steps


@pytest.mark.parametrize("tied", [False, True])
def test_step0_rows_model_gives_the_whole_tables_logits(tied):
    """The insertion-step0 analysis builds only the table rows its windows read (stem.analysis.insertion.
    inserted_rows): its logits equal those of the whole inserted model (projected, raw), every other weight is the
    dense model's, and a token it was not built for is refused."""
    import dataclasses
    from stem.analysis.insertion import inserted_rows
    from stem.models.spec import ModelConfig
    from stem.models.insert import insert_stem
    cfg = ModelConfig(vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64,
                      tie_embeddings=tied)
    torch.manual_seed(3)
    dense = build_model(cfg).eval()
    stem_cfg = dataclasses.replace(cfg, ffn=("dense", "stem", "dense", "stem"))
    x = torch.randint(0, 60, (2, 24))
    for init in ("projected", "raw"):
        whole = build_model(stem_cfg).eval()
        insert_stem(whole, dense.state_dict(), init)
        rows = inserted_rows(stem_cfg, dense.state_dict(), init, x.unique())
        assert (rows.lm_head.weight is rows.tok_emb.weight) == tied
        with torch.no_grad():
            torch.testing.assert_close(rows(x), whole(x), rtol=1e-5, atol=1e-5)
        with pytest.raises(IndexError):
            rows(torch.tensor([[96]]))
    xav = inserted_rows(stem_cfg, dense.state_dict(), "xavier", x.unique())
    assert xav.layers[1].ffn.table.rows.std().item() == pytest.approx((2 / (97 + 48)) ** 0.5, rel=0.2)
