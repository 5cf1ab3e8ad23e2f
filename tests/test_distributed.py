"""Distributed training on the CPU (gloo): 2 processes == 1 process, checkpoints reshard across world sizes.

Two ranks and one process, forked from the test's (no interpreter to start), each run a list of small jobs (dense,
STEM, Hash-MoE, routed MoE, FSDP and the DDP-backbone strategy) through the training loop to amortise start-up; the
tests compare their metrics.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork: FSDP2 would import it in each of them)
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from stem import config as C  # noqa: E402
from stem.models.model import build_model  # noqa: E402
from stem.train import comms, memory  # noqa: E402
from stem.train.loop import train  # noqa: E402
from stem.train.plan import ParallelPlan, local_micro_batch  # noqa: E402
from conftest import reshaped  # noqa: E402


def _jobs_rank(jobs: list):
    """One rank (forked from the test's process, torch imported: no interpreter to start): the jobs in turn through
    the real training loop, in one gloo group for all of them (train() joins it, does not destroy it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    for job in jobs:
        job["spec"]["train"]["parallel"] = job.get("strategy", "fsdp")   # the backbone's strategy travels in the spec
        train(job["spec"], threads=1, max_steps=job.get("max_steps"))


def _make_data(root: Path) -> tuple[str, str]:
    from stem.data.shards import tokenize_to_shards
    from stem.data.synth import make_world, web_documents
    from stem.data.tokenizer import load_tokenizer, train_bpe
    import itertools
    docs = list(itertools.islice(web_documents(make_world(seed=3, n_countries=8, n_people=20, n_filler=100), seed=1), 300))
    tok_path = root / "tokenizer.json"
    train_bpe(docs, 300, tok_path)
    tokenize_to_shards(iter(docs), load_tokenizer(tok_path), root / "tokens", val_fraction=0.1)
    return str(tok_path), str(root / "tokens" / "manifest.json")


def _spec(variant, tok, manifest, out_dir, steps=6):
    cfg = C.read_yaml(REPO / "config" / "tiny.yaml")
    cfg["archs"]["350m"].update(vocab_size=320, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=64,
                                max_seq_len=64)
    cfg["variant_overrides"] = {"hashmoe": {"n_experts": 4}, "moe": {"moe_experts": 4, "moe_d_ff": 32}}
    cfg["stages"]["pretrain"]["350m"].update(batch_size=8, micro_batch=8, seq_len=32, steps=steps, lr=3e-3)
    cfg["train"].update(log_interval=100, eval_interval=3, eval_batches=2, checkpoint_interval=3)
    if variant == "dense_tied":   # the LM head is the embedding (tie_embeddings): both in the root FSDP unit
        cfg["archs"]["350m"]["tie_embeddings"] = True
        variant = "dense"
    if variant == "moe":   # the balance loss is per forward call: both world sizes run micro-batches of 4 rows
        cfg["stages"]["pretrain"]["350m"]["micro_batch"] = 4
    spec = C.train_spec(reshaped(cfg), "350m", variant, "pretrain")
    spec["data"] = {"web": {"weight": 1.0, "manifest": manifest}}
    spec.update(tokenizer=tok, out_dir=str(out_dir), device="cpu")
    return spec


def _run(jobs, nproc: int):
    """The jobs at world size ``nproc``: that many ranks forked from this process (stem.train.comms.fork_ranks
    sets each one's RANK, WORLD_SIZE, MASTER_ADDR/PORT as torchrun would; the launcher's own command line is
    tests/test_slurm.py's)."""
    assert comms.fork_ranks(_jobs_rank, nproc, json.loads(json.dumps(jobs))) == [0] * nproc


def _packed(spec, micro):
    """Packed rows with cross-document masking: micro-batches carry different numbers of targets."""
    spec["train"].update(cross_doc_mask=True, micro_batch=micro, seq_len=48)
    return spec


def _losses(out_dir):
    rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows], [r["val_loss"] for r in rows if "val_loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dist")
    tok, manifest = _make_data(tmp / "data")
    # stem_sparse: optim.table_update sparse; dense_tied: tie_embeddings (one parameter across the embedding and head)
    variants = ["dense", "stem", "hashmoe", "stem_sparse", "moe", "dense_tied"]
    one = [{"spec": _spec(v, tok, manifest, tmp / "w1" / v)} for v in variants]
    two = [{"spec": _spec(v, tok, manifest, tmp / "w2" / v)} for v in variants]
    for job in one + two:   # STEM also saves its final optimizer state (for reset_optimizer: false)
        job["spec"]["train"]["save_optimizer"] = job["spec"]["variant"] in ("stem", "stem_sparse")
    two += [{"spec": _spec(v, tok, manifest, tmp / "w2ddp" / v), "strategy": "ddp"}
            for v in ("dense", "stem", "stem_sparse", "moe")]
    # token-mean accumulation: 2 ranks x 2 micro-batches of 2 packed rows vs one micro-batch of 8 rows
    one += [{"spec": _packed(_spec("stem", tok, manifest, tmp / "w1packed"), 8)}]
    two += [{"spec": _packed(_spec("stem", tok, manifest, tmp / "w2packed"), 2)}]
    # gradients reduce-scattered every micro-batch: batch 8 in micro-batches of 2, 3 steps (4 a step at world 1,
    # 2 a rank at world 2)
    for jobs, world in ((one, 1), (two, 2)):
        spec = _spec("stem", tok, manifest, tmp / f"accum{world}", steps=3)
        spec["train"].update(micro_batch=2)
        jobs.append({"spec": spec})
    # saved at world size 2 after 4 steps (a DCP state), resumed below at world size 1
    two += [{"spec": _spec(v, tok, manifest, tmp / "reshard" / v), "max_steps": 4} for v in ("stem", "stem_sparse")]
    _run(two, 2)
    for v in ("stem", "stem_sparse"):
        state = tmp / "reshard" / v / "_state"
        saved = state / (state / "latest").read_text().strip()
        (tmp / f"saved_at_two_{v}.json").write_text(json.dumps(
            {"dcp": (saved / "dcp").is_dir(), **json.loads((saved / "extra.json").read_text())}))
        one += [{"spec": _spec(v, tok, manifest, tmp / "reshard" / v)}]
    _run(one, 1)
    return tmp


@pytest.mark.parametrize("variant", ["dense", "stem", "hashmoe", "stem_sparse", "moe", "dense_tied"])
def test_two_ranks_follow_one_rank_loss_curve(runs, variant):
    (l1, v1), (l2, v2) = _losses(runs / "w1" / variant), _losses(runs / "w2" / variant)
    assert len(l1) == len(l2) == 6 and len(v1) == len(v2) == 2
    assert l2 == pytest.approx(l1, rel=1e-4, abs=1e-5)
    assert v2 == pytest.approx(v1, rel=1e-4, abs=1e-5)
    assert l1[-1] < l1[0]  # it trains
    s1 = json.loads((runs / "w1" / variant / "summary.json").read_text())
    s2 = json.loads((runs / "w2" / variant / "summary.json").read_text())
    assert (s1["world_size"], s2["world_size"]) == (1, 2)
    assert s2["total_params"] == s1["total_params"]  # the gathered checkpoint is the full model
    # the modelled communication (stem.train.comms, checked against counted bytes in test_comms.py)
    assert s1["comms"]["total_bytes"] == 0 and s2["comms"]["world"] == 2 and s2["comms"]["total_bytes"] > 0
    assert (s2["comms"]["table_bytes"] > 0) == (variant not in ("dense", "dense_tied"))


def test_two_ranks_accumulating_micro_batches_follow_one_rank(runs):
    """Gradients reduce-scattered every micro-batch (2 per rank per step here) give one rank's loss curve. (Was
    tests/test_memory.py's, with a torchrun of its own; here it shares this file's two runs.)"""
    (l1, _), (l2, _) = _losses(runs / "accum1"), _losses(runs / "accum2")
    assert len(l1) == 3 and l2 == pytest.approx(l1, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("variant", ["dense", "stem", "stem_sparse", "moe"])
def test_ddp_backbone_with_sharded_tables_matches(runs, variant):
    assert _losses(runs / "w2ddp" / variant)[0] == pytest.approx(_losses(runs / "w1" / variant)[0], rel=1e-4, abs=1e-5)


def test_sparse_table_update_trains_differently_at_both_world_sizes(runs):
    """Same model and data, so the same first loss; then the row-wise update (replicated tables, all-gathered
    rows) departs from dense AdamW (sharded tables), at 1 and 2 ranks alike."""
    from safetensors.torch import load_file
    for world in ("w1", "w2"):
        dense, sparse = _losses(runs / world / "stem")[0], _losses(runs / world / "stem_sparse")[0]
        assert sparse[0] == pytest.approx(dense[0], rel=1e-6)
        a, b = (load_file(str(runs / world / v / "checkpoint" / "model.safetensors")) for v in ("stem", "stem_sparse"))
        table = "layers.2.ffn.table.weight"
        assert (a[table] - b[table]).abs().max().item() > 1e-3   # dense AdamW kept moving untouched rows


def test_packed_rows_two_ranks_small_micro_batches_follow_one_big_batch(runs):
    """The step is the token mean over all micro-batches and ranks, whatever the split (issue 10, item 4)."""
    (l1, _), (l2, _) = _losses(runs / "w1packed"), _losses(runs / "w2packed")
    assert len(l1) == len(l2) == 6 and l1[-1] < l1[0]
    assert l2 == pytest.approx(l1, rel=2e-6, abs=1e-6)   # mean-of-micro-batch-means drifts by ~1e-4 here


@pytest.mark.parametrize("variant", ["stem", "stem_sparse", "moe", "dense_tied"])
def test_final_checkpoints_match_across_world_sizes(runs, variant):
    from safetensors.torch import load_file
    a = load_file(str(runs / "w1" / variant / "checkpoint" / "model.safetensors"))
    b = load_file(str(runs / "w2" / variant / "checkpoint" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert ("lm_head.weight" in a) == (variant != "dense_tied")   # a tied head is saved once, as the embedding
    for k in a:
        assert a[k].shape == b[k].shape
        assert (a[k] - b[k]).abs().max().item() < 1e-4, k


@pytest.mark.parametrize("variant", ["stem", "stem_sparse"])
def test_optimizer_state_saved_at_two_ranks_loads_at_one(runs, variant):
    """checkpoint/optimizer/ (DCP, sharded at 2 ranks) loads into a single process like the 1-rank one."""
    from stem.models.spec import ModelConfig
    from stem.checkpoint import read_checkpoint_spec
    from stem.train.optstate import load_optimizer
    from stem.optim import build_optimizer
    states = []
    for world in ("w1", "w2"):
        ckpt = runs / world / variant / "checkpoint"
        spec = read_checkpoint_spec(ckpt)
        model = build_model(ModelConfig.from_dict(spec["model"]))
        opt = build_optimizer(model, spec["optim"], 1.0)
        load_optimizer(ckpt / "optimizer", model, opt)
        states.append({n: opt.state[p] for n, p in model.named_parameters()})
    one, two = states
    assert len(list((runs / "w2" / variant / "checkpoint" / "optimizer").glob("*.distcp"))) == 2   # one per rank
    assert one.keys() == two.keys() and all(float(s["step"]) == 6 for s in one.values())
    for name in one:
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(two[name][k], one[name][k], rtol=1e-3, atol=1e-9), (name, k)


@pytest.mark.parametrize("variant", ["stem", "stem_sparse"])
def test_state_saved_at_two_ranks_resumes_at_one(runs, variant):
    saved = json.loads((runs / f"saved_at_two_{variant}.json").read_text())
    assert saved["dcp"] and saved["world_size"] == 2 and saved["step"] == 4
    assert not (runs / "reshard" / variant / "summary.json").exists() or \
        json.loads((runs / "reshard" / variant / "summary.json").read_text())["world_size"] == 1
    full, _ = _losses(runs / "w1" / variant)
    resumed, _ = _losses(runs / "reshard" / variant)
    assert resumed == pytest.approx(full, rel=1e-4, abs=1e-5)


def test_local_micro_batch_split():
    assert local_micro_batch(512, 16, 1) == (16, 32)
    assert local_micro_batch(512, 16, 8) == (16, 32)
    assert local_micro_batch(16, 16, 2) == (8, 2)
    with pytest.raises(ValueError, match="multiple"):
        local_micro_batch(12, 8, 8)


def test_memory_estimate_shards_tables_over_all_ranks():
    cfg = C.experiment.load(REPO / "config" / "paper.yaml")
    model = build_model(C.model_config_for(cfg, "350m", "stem", "pretrain"), "meta")
    e1, e8, d8 = (memory.estimate(model, ParallelPlan(world, strategy, 16, 32, 2048))
                  for world, strategy in ((1, "fsdp"), (8, "fsdp"), (8, "ddp")))
    assert e8["optimizer_gib"] == pytest.approx(e1["optimizer_gib"] / 8)
    assert e8["optimizer_gib"] < d8["optimizer_gib"] < e1["optimizer_gib"]  # ddp: only the tables are sharded
    assert e8["sharded_table_params"] > 0 and "per-GPU memory estimate" in memory.describe(e8)
