"""Checkpoints between stages and resumable state: what a job reads is what it expects, bad files are one
line naming the file, a damaged state falls back to the previous one, reset_optimizer (issues 10 and 16)."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from conftest import make_spec
from stem import config as C
from stem.checkpoint import load_checkpoint
from stem.train.loop import TrainingError, train


@pytest.fixture(scope="module")
def pre(tiny_data, tmp_path_factory):
    """A finished 12-step STEM pretraining job that also saves its optimizer state (for reset_optimizer: false)."""
    out = tmp_path_factory.mktemp("pre") / "pre"
    spec = make_spec(tiny_data, out)
    spec["train"]["save_optimizer"] = True
    return out, train(spec, threads=1)


def _mid(tiny_data, out, pre_dir, **train_kw):
    spec = make_spec(tiny_data, out, stage="midtrain", schedule="linear", **train_kw)
    spec.update(init_from=str(pre_dir / "checkpoint"), init_stage="pretrain")
    return spec


def _copy_ckpt(pre_dir, tmp_path):
    shutil.copytree(pre_dir / "checkpoint", tmp_path / "ckpt")
    return tmp_path / "ckpt"


# ---- init_from: the expected checkpoint, readable ------------------------------------------------
@pytest.mark.parametrize("change, message", [
    ({"variant": "dense"}, "has variant 'stem', expected 'dense'"),
    ({"init_stage": "midtrain"}, "has stage 'pretrain', expected 'midtrain'"),
    ({"experiment": "paper"}, "has experiment 'tiny', expected 'paper'"),
])
def test_init_from_must_be_the_expected_experiment_variant_and_stage(tiny_data, tmp_path, pre, change, message):
    spec = _mid(tiny_data, tmp_path / "mid", pre[0])
    if "variant" in change:  # a dense job pointed at the STEM checkpoint
        spec["model"] = make_spec(tiny_data, tmp_path, variant="dense")["model"]
    spec.update(change)
    with pytest.raises(TrainingError, match=f"{pre[0] / 'checkpoint' / 'config.json'}: init_from checkpoint {message}"):
        train(spec, threads=1, max_steps=0)
    assert not (tmp_path / "mid" / "_state").exists()


def test_init_from_with_another_architecture_names_the_key(tiny_data, tmp_path, pre):
    spec = _mid(tiny_data, tmp_path / "mid", pre[0])
    spec["model"]["d_ff"] = 64
    with pytest.raises(TrainingError, match=r"config.json: init_from checkpoint has model.d_ff 48, expected 64"):
        train(spec, threads=1, max_steps=0)


def test_garbage_checkpoint_config_is_one_line(tiny_data, tmp_path, pre):
    ckpt = _copy_ckpt(pre[0], tmp_path)
    (ckpt / "config.json").write_text('{"model": {"vocab_size": 5')
    spec = _mid(tiny_data, tmp_path / "mid", pre[0])
    spec["init_from"] = str(ckpt)
    with pytest.raises(TrainingError, match=f"init_from: {ckpt / 'config.json'}: not valid JSON"):
        train(spec, threads=1, max_steps=0)
    with pytest.raises(ValueError, match=f"{ckpt / 'config.json'}: not valid JSON") as e:
        load_checkpoint(ckpt)   # evaluation's loader
    assert "\n" not in str(e.value)
    (ckpt / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a checkpoint config"):
        load_checkpoint(ckpt)


def test_truncated_weights_are_one_line_naming_the_file(tiny_data, tmp_path, pre):
    ckpt = _copy_ckpt(pre[0], tmp_path)
    weights = ckpt / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ValueError, match=f"{weights}: unreadable safetensors file"):
        load_checkpoint(ckpt)
    spec = _mid(tiny_data, tmp_path / "mid", pre[0])
    spec["init_from"] = str(ckpt)
    r = subprocess.run([sys.executable, "-m", "workflow_scripts.train", "--spec", json.dumps(spec), "--threads", "1"],
                       cwd=C.REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(C.REPO)})
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 1 and lines[-1].startswith(f"error: {weights}: unreadable safetensors file")
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "mid" / "checkpoint").exists()


# ---- reset_optimizer ------------------------------------------------------------------------------
def _optim_pt(folder):
    return torch.load(folder / "optim.pt", weights_only=True)


def test_reset_optimizer_false_carries_the_previous_stage_state(tiny_data, tmp_path, pre):
    final = _optim_pt(pre[0] / "_state" / "step_00000012")   # pretraining's last optimizer state
    assert (pre[0] / "checkpoint" / "optimizer" / ".metadata").is_file()
    carried = _mid(tiny_data, tmp_path / "carry", pre[0], reset_optimizer=False)
    carried["optim"] = {**carried["optim"], "weight_decay": 0.05}   # the new stage's hyper-parameters win
    train(carried, threads=1, max_steps=0)   # saves the state before any update
    start = _optim_pt(tmp_path / "carry" / "_state" / "step_00000000")
    assert start["state"].keys() == final["state"].keys() and len(final["state"]) > 10
    for i, s in final["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(start["state"][i][k], s[k]), (i, k)
    by_name = {g["name"]: g for g in start["param_groups"]}
    assert by_name["matrix"]["weight_decay"] == 0.05 and by_name["norm"]["weight_decay"] == 0.0

    train(_mid(tiny_data, tmp_path / "fresh", pre[0], reset_optimizer=True), threads=1, max_steps=0)
    assert _optim_pt(tmp_path / "fresh" / "_state" / "step_00000000")["state"] == {}


def test_reset_optimizer_false_needs_the_saved_state(tiny_data, tmp_path, pre):
    ckpt = _copy_ckpt(pre[0], tmp_path)
    shutil.rmtree(ckpt / "optimizer")
    spec = _mid(tiny_data, tmp_path / "mid", pre[0], reset_optimizer=False)
    spec["init_from"] = str(ckpt)
    with pytest.raises(ValueError, match=f"{ckpt / 'optimizer'}: no optimizer state in this checkpoint"):
        train(spec, threads=1, max_steps=0)


def test_reset_optimizer_in_the_config_decides_what_the_previous_stage_saves():
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    exp = C.experiment.parse(cfg, "tiny.yaml")
    assert C.train_spec(exp, "1b", "stem", "midtrain")["train"]["reset_optimizer"] is True
    assert C.train_spec(exp, "1b", "stem", "pretrain")["train"]["save_optimizer"] is False
    cfg["stages"]["midtrain"]["1b"]["reset_optimizer"] = False
    exp = C.experiment.parse(cfg, "tiny.yaml (midtrain carries the optimizer)")
    assert C.train_spec(exp, "1b", "stem", "midtrain")["train"]["reset_optimizer"] is False
    assert C.train_spec(exp, "1b", "stem", "pretrain")["train"]["save_optimizer"] is True
    assert C.train_spec(exp, "1b", "stem", "midtrain")["train"]["save_optimizer"] is False
    cfg["stages"]["pretrain"]["1b"]["reset_optimizer"] = False
    with pytest.raises(C.ConfigError, match="stages.pretrain.1b.reset_optimizer': false needs an init_from"):
        C.experiment.parse(cfg)


# ---- resumable state integrity --------------------------------------------------------------------
def test_truncated_state_falls_back_to_the_previous_one(tiny_data, tmp_path, pre, capfd):
    spec = make_spec(tiny_data, tmp_path / "split")
    train(spec, threads=1, max_steps=8)   # states at steps 4 and 8
    state = tmp_path / "split" / "_state"
    assert (state / "latest").read_text().strip() == "step_00000008"
    bad = state / "step_00000008" / "model.safetensors"
    os.truncate(bad, bad.stat().st_size - 100)
    capfd.readouterr()
    resumed = train(spec, threads=1)
    err = capfd.readouterr().err
    assert f"warning: {bad}: " in err and "expected" in err and "falling back" in err
    assert "resuming at step 4" in err
    assert resumed["last_step_loss"] == pre[1]["last_step_loss"]
    rows = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))


def test_no_complete_state_is_one_clear_error(tiny_data, tmp_path):
    spec = make_spec(tiny_data, tmp_path / "run")
    train(spec, threads=1, max_steps=4)
    state = tmp_path / "run" / "_state" / "step_00000004"
    (state / "extra.json").write_text("{")   # same size check fails: the manifest recorded another size
    with pytest.raises(ValueError, match=r"_state: no complete state to resume from \(.*extra.json"):
        train(spec, threads=1)


def test_a_state_another_spec_saved_is_not_resumed(tiny_data, tmp_path, pre, capfd):
    """Issue 39: Snakemake reruns a job whose spec changed, removing its declared outputs but not ``_state/``; the
    new spec starts over (the same model as a fresh run of it) instead of ending at the old spec's last state."""
    train(make_spec(tiny_data, tmp_path / "run", lr=1e-2), threads=1, max_steps=12)   # another spec's states, 4..12
    assert (tmp_path / "run" / "_state" / "latest").read_text().strip() == "step_00000012"
    capfd.readouterr()
    rerun = train(make_spec(tiny_data, tmp_path / "run"), threads=1)
    err = capfd.readouterr().err
    assert "_state: saved by another job spec (" in err and "starting over" in err and "resuming" not in err
    assert rerun["last_step_loss"] == pre[1]["last_step_loss"]   # pre: the same spec run fresh
    rt = rerun["runtime"]   # what the numbers were computed with (issue 39: nothing runs elsewhere silently)
    assert (rt["device"], rt["requested_device"], rt["dtype"], rt["threads"], rt["deterministic"]) == \
        ("cpu", "cpu", "float32", 1, True) and rt["autocast"] is None and rt["attention"] == "sdpa"
    train(make_spec(tiny_data, tmp_path / "run"), threads=1)   # its own state: resumed (nothing left to do)
    assert "resuming at step 12" in capfd.readouterr().err
