"""Training core: schedules, the mixture loader, resume determinism (incl. SIGKILL), bad runs."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from stem.data.loader import MixtureLoader, positions_from_docs
from stem.data.shards import ShardSet
from stem.checkpoint import load_checkpoint
from stem.train.loop import TrainingError, train
from stem.train.schedule import get_lr

from killing import sigkill_after_state

REPO = Path(__file__).resolve().parents[1]


def test_cosine_schedule_warmup_peak_and_floor():
    kw = dict(lr=1.0, steps=1000, warmup=0.01, schedule="cosine", min_lr_ratio=0.1)
    assert get_lr(0, **kw) == pytest.approx(0.1)
    assert get_lr(9, **kw) == pytest.approx(1.0)
    assert get_lr(999, **kw) == pytest.approx(0.1, abs=1e-4)
    assert get_lr(505, **kw) == pytest.approx(0.55, abs=0.01)
    # a longer horizon (the OLMo 5T layout stopped at 1T) keeps the LR high at the stop
    assert get_lr(999, **kw, schedule_steps=5000) > 0.9


def test_linear_schedule():
    kw = dict(lr=1.0, steps=100, warmup=0.0, schedule="linear", min_lr_ratio=0.0)
    assert get_lr(0, **kw) == 1.0 and get_lr(50, **kw) == pytest.approx(0.5) and get_lr(100, **kw) == 0.0


def _loader(tiny_data, weights, packed=False, seq_len=32, mb=4):
    sources = {s: (ShardSet(Path(tiny_data["manifests"][s]).parent), w) for s, w in weights.items()}
    return MixtureLoader(sources, seq_len, mb, seed=0, packed=packed)


def test_mixture_delivers_configured_token_proportions(tiny_data):
    weights = {"web": 0.65, "math": 0.05, "long": 0.30}
    loader = _loader(tiny_data, weights)
    for _ in range(100):
        loader.next_batch()
    total = sum(loader.tokens_by_source.values())
    assert total == 100 * 4 * 32
    for s, w in weights.items():
        assert abs(loader.tokens_by_source[s] / total - w) <= 1 / 400  # within one sequence of 400


def test_loader_is_deterministic_and_resumable(tiny_data):
    weights = {"web": 0.7, "long": 0.3}
    a = _loader(tiny_data, weights)
    for _ in range(5):
        a.next_batch()
    state = json.loads(json.dumps(a.state_dict()))
    expected = [a.next_batch()[0] for _ in range(3)]
    b = _loader(tiny_data, weights)
    b.load_state_dict(state)
    for x in expected:
        assert torch.equal(b.next_batch()[0], x)


def test_packed_rows_restart_positions_and_mask_cross_document_targets(tiny_data):
    loader = _loader(tiny_data, {"web": 1.0}, packed=True, seq_len=128, mb=2)
    eos = ShardSet(Path(tiny_data["manifests"]["web"]).parent).eos_id
    x, y, pos = loader.next_batch()
    assert pos.shape == x.shape and (pos[:, 0] == 0).all()
    starts = (pos == 0).nonzero().tolist()
    assert len(starts) > 2  # several documents per row
    for b, t in starts:
        if t > 0:
            assert y[b, t - 1] == -1  # no target across a document boundary
            assert x[b, t - 1] == eos or pos[b, t - 1] >= 0
    assert (pos[:, 1:] == pos[:, :-1] + 1).logical_or(pos[:, 1:] == 0).all()
    assert positions_from_docs(np.array([0, 0, 1, 1, 1, -1])).tolist() == [0, 1, 0, 1, 2, 0]


@pytest.mark.parametrize("variant", ["dense", "stem", "hashmoe", "moe"])
def test_resume_gives_the_same_final_loss(spec_factory, tmp_path, variant):
    full = train(spec_factory(tmp_path / "full", variant=variant), threads=1)
    spec = spec_factory(tmp_path / "split", variant=variant)
    train(spec, threads=1, max_steps=5)
    assert not (tmp_path / "split" / "summary.json").exists()
    resumed = train(spec, threads=1)
    assert resumed["last_step_loss"] == full["last_step_loss"]
    assert resumed["final_val_loss"] == full["final_val_loss"]
    rows = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    # the routed MoE logs its balance loss beside the cross-entropy (~ alpha x 2 MoE layers when balanced)
    assert all(("aux_loss" in r) == (variant == "moe") for r in rows)
    if variant == "moe":
        assert all(0 < r["aux_loss"] < 0.1 and r["loss"] > 1 for r in rows)


def test_sigkill_then_rerun_ends_with_the_same_loss(spec_factory, tmp_path):
    full = train(spec_factory(tmp_path / "full", steps=40, checkpoint_interval=5), threads=1)
    spec = spec_factory(tmp_path / "killed", steps=40, checkpoint_interval=5)
    sigkill_after_state(spec, 10)
    resumed = train(spec, threads=1)
    assert resumed["last_step_loss"] == full["last_step_loss"]


def test_init_from_starts_from_exactly_those_weights(spec_factory, tmp_path):
    train(spec_factory(tmp_path / "pre", variant="stem"), threads=1)
    spec = spec_factory(tmp_path / "mid", variant="stem", stage="midtrain", schedule="linear",
                        data={"web": 0.65, "math": 0.35})
    spec.update(init_from=str(tmp_path / "pre" / "checkpoint"), init_stage="pretrain")
    train(spec, threads=1, max_steps=0)  # saves the state before any update
    pre, _ = load_checkpoint(tmp_path / "pre" / "checkpoint")
    from safetensors.torch import load_file
    start = load_file(str(tmp_path / "mid" / "_state" / "step_00000000" / "model.safetensors"))
    for k, v in pre.state_dict().items():
        assert torch.equal(start[k], v), k
    # the spec as stem.config builds it, unserialised (python -m stem train): tuples where JSON has lists
    spec.update(out_dir=str(tmp_path / "mid2"), model={**spec["model"], "ffn": tuple(spec["model"]["ffn"])})
    assert train(spec, threads=1, max_steps=0)["step"] == 0


def test_non_finite_loss_stops_with_a_clear_error(spec_factory, tmp_path):
    spec = spec_factory(tmp_path / "nan", lr=1e30, warmup=0.0)
    with pytest.raises(TrainingError, match="non-finite training loss"):
        train(spec, threads=1)
    assert not (tmp_path / "nan" / "summary.json").exists()
    assert not (tmp_path / "nan" / "checkpoint").exists()


def test_checkpoint_holds_config_tokenizer_and_weights(spec_factory, tmp_path):
    s = train(spec_factory(tmp_path / "run", variant="stem_half"), threads=1)
    ckpt = tmp_path / "run" / "checkpoint"
    assert {p.name for p in ckpt.iterdir()} >= {"model.safetensors", "config.json", "tokenizer.json", "accounting.json"}
    model, spec = load_checkpoint(ckpt)
    assert spec["variant"] == "stem_half" and model.cfg.ffn.count("stem") == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("final_train_loss", "final_val_loss", "steps", "tokens", "train_flops", "wall_seconds"):
        assert key in summary
    assert summary["tokens"] == 12 * 4 * 32 and summary["train_flops"] == 6 * s["active_params"] * summary["tokens"]


@pytest.mark.parametrize("stage", ["midtrain", "extend"])
def test_resume_in_the_middle_of_later_stages(spec_factory, tmp_path, stage):
    train(spec_factory(tmp_path / "pre"), threads=1)

    def spec(name):
        if stage == "midtrain":
            s = spec_factory(tmp_path / name, stage=stage, schedule="linear", data={"web": 0.65, "math": 0.35})
        else:
            s = spec_factory(tmp_path / name, stage=stage, data={"long": 0.63, "web": 0.37}, seq_len=96,
                             cross_doc_mask=True, activation_checkpointing=True)
            s["model"]["rope_scaling"] = {"kind": "theta", "theta": 1e6}
        s.update(init_from=str(tmp_path / "pre" / "checkpoint"), init_stage="pretrain")
        return s

    full = train(spec("full"), threads=1)
    train(spec("split"), threads=1, max_steps=7)
    resumed = train(spec("split"), threads=1)
    assert resumed["last_step_loss"] == full["last_step_loss"]
    assert resumed["tokens_by_source"] == full["tokens_by_source"]
