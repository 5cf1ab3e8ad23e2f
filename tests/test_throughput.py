"""Tokens/s per GPU and MFU in every training run (issue 22, item 2): the FLOP formula against a hand count,
the peak table, the meter's arithmetic, and a real run's progress line, metrics, summary and TensorBoard."""
import json
import re
import sys

import pytest
import torch

from conftest import make_spec
from stem.models.accounting import accounting, attention_flops_per_token, flops_per_token
from stem.models.spec import ModelConfig
from stem.models.model import build_model
from stem.specs import SpecError, TrainSpec
from stem.train import throughput
from stem.train.loop import train
from stem.train.step import TrainingError

TINY = dict(vocab_size=512, d_model=32, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=48, max_seq_len=256)


def _hand_dense_matmul_params(d=32, layers=3, heads=2, kv=1, d_ff=48, vocab=512):
    hd = d // heads
    attn = d * heads * hd + 2 * d * kv * hd + heads * hd * d   # wq, wk, wv, wo
    ffn = 3 * d * d_ff                                         # SwiGLU: gate, up, down
    norms = 2 * d
    return layers * (attn + ffn + norms) + d + vocab * d       # + final norm + LM head (the embedding is a lookup)


def test_flops_per_token_against_a_hand_count():
    cfg = ModelConfig(**TINY)
    acct = accounting(build_model(cfg, "meta"))
    attn = 12 * 3 * 2 * 16 * 32                              # 12 x layers x heads x head_dim x seq_len
    assert attention_flops_per_token(cfg, 32) == attn
    assert flops_per_token(acct, cfg, 32) == 6 * _hand_dense_matmul_params() + attn
    # STEM in layer 1: its up-projection (d x d_ff) is a table lookup, zero FLOPs
    stem = ModelConfig(**TINY, ffn=("dense", "stem", "dense"))
    acct = accounting(build_model(stem, "meta"))
    assert flops_per_token(acct, stem, 32) == 6 * (_hand_dense_matmul_params() - 32 * 48) + attn


def test_peak_table_and_device_peak():
    assert throughput.known_peak("NVIDIA H100 80GB HBM3")[0] == 989
    assert throughput.known_peak("NVIDIA H100 PCIe")[0] == 756
    assert throughput.known_peak("NVIDIA H200")[0] == 989
    assert throughput.known_peak("NVIDIA A100-SXM4-80GB")[0] == 312
    assert throughput.known_peak("NVIDIA A10")[0] == 125 and throughput.known_peak("NVIDIA L4")[0] == 121
    assert throughput.known_peak("NVIDIA L40S")[0] == 362
    assert throughput.known_peak("NVIDIA GeForce GTX 1080") is None
    peak, why = throughput.device_peak(torch.device("cpu"))
    assert peak is None and "train.peak_tflops" in why
    assert throughput.device_peak(torch.device("cpu"), 100) == (100.0, "train.peak_tflops")


def test_meter_arithmetic():
    m = throughput.Meter(flops_per_token=6e9, world=2, peak_tflops=989.0, peak_source="x")
    r = m.row(400_000.0)
    assert r["tokens_per_s_per_gpu"] == 200_000.0
    assert r["mfu"] == pytest.approx(6e9 * 2e5 / 989e12)
    assert m.line(400_000.0) == " (200,000 tok/s/gpu, MFU 121.3%)"
    # the summary: steps 6.. (5 warm-up steps left out), tokens / seconds over them
    rates = [1.0, 1.0, 1.0, 1.0, 1.0, 100.0, 300.0]          # tokens/s; 100 tokens a step
    rows = [{"step": i + 1, "tokens_per_s": t} for i, t in enumerate(rates)]
    s = m.summary(rows, tokens_per_step=100)
    assert s["tokens_per_s_per_gpu"] == pytest.approx(200 / (1 + 1 / 3) / 2)
    assert s["mfu"] == pytest.approx(6e9 * s["tokens_per_s_per_gpu"] / 989e12)
    assert s["throughput_steps"].startswith("6-7 ")
    cpu = throughput.Meter(1e6, 1, None, "no peak").summary(rows[:3], 100)
    assert cpu["mfu"] is None and cpu["peak_source"] == "no peak" and cpu["throughput_steps"].startswith("2-3 ")
    assert throughput.Meter(1e6, 1, None, "no peak").line(5.0) == ""


def test_new_train_keys_are_checked_and_left_out_at_their_defaults(tiny_data, tmp_path):
    spec = make_spec(tiny_data, tmp_path)
    assert not {"peak_tflops", "wandb", "compile"} & set(spec["train"])
    assert TrainSpec.from_dict(spec).to_dict() == spec
    for key, bad in (("peak_tflops", 0), ("wandb", " "), ("compile", "yes")):
        with pytest.raises(SpecError, match=f"key 'train.{key}'"):
            TrainSpec.from_dict({**spec, "train": {**spec["train"], key: bad}})


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [e.value for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_run_logs_tokens_per_s_and_mfu(tiny_data, tmp_path, capfd):
    spec = make_spec(tiny_data, tmp_path / "run", steps=8, log_interval=4, tensorboard=True, peak_tflops=0.5)
    summary = train(spec, threads=1)
    lines = [x for x in capfd.readouterr().out.splitlines() if "] step " in x]
    assert len(lines) == 2 and all(re.search(r" tok/s \(MFU \d+\.\d%\) ETA ", x) for x in lines), lines
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    fpt = summary["flops_per_token"]
    for r in rows:
        assert r["tokens_per_s_per_gpu"] == r["tokens_per_s"]          # world 1
        assert r["mfu"] == pytest.approx(fpt * r["tokens_per_s"] / 0.5e12)
    timed = rows[5:]
    mean = len(timed) * 128 / sum(128 / r["tokens_per_s"] for r in timed)
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(mean)
    assert summary["mfu"] == pytest.approx(fpt * mean / 0.5e12) and summary["peak_tflops"] == 0.5
    assert summary["throughput_steps"].startswith("6-8 ")
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["mfu"] == pytest.approx(summary["mfu"])
    tb = _scalars(tmp_path / "run" / "tensorboard")
    assert tb["train/mfu"] == pytest.approx([r["mfu"] for r in rows], rel=1e-6)
    assert tb["train/tokens_per_s_per_gpu"] == pytest.approx([r["tokens_per_s_per_gpu"] for r in rows], rel=1e-6)


def test_on_the_cpu_mfu_is_null_with_the_reason(tiny_data, tmp_path):
    summary = train(make_spec(tiny_data, tmp_path / "run", steps=3), threads=1)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all("mfu" not in r and r["tokens_per_s_per_gpu"] > 0 for r in rows)
    assert summary["mfu"] is None and summary["peak_tflops"] is None
    assert "no dense bf16 peak for device cpu" in summary["peak_source"]


def test_wandb_missing_is_one_line(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)   # import wandb raises ImportError
    with pytest.raises(TrainingError,
                       match=r"^train.wandb: 'stem-repro' needs the wandb package \(pip install wandb\)"):
        train(make_spec(tiny_data, tmp_path / "run", steps=2, wandb="stem-repro"), threads=1)
