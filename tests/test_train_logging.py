"""What a running job shows: a progress line on the job's output, TensorBoard scalars (issue 16, items 9, 12)."""
import json
import re
import shutil

import pytest

from conftest import make_spec
from stem import config as C
from stem.train.loop import Progress, train


def _rows(out_dir):
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


def test_progress_line_on_stdout_every_log_interval(tiny_data, tmp_path, capfd):
    capfd.readouterr()
    train(make_spec(tiny_data, tmp_path / "run", log_interval=4), threads=1)
    out = capfd.readouterr().out
    lines = [line for line in out.splitlines() if "] step " in line]
    assert [int(re.search(r"step (\d+)/12 ", line).group(1)) for line in lines] == [4, 8, 12]
    losses = {r["step"]: r["loss"] for r in _rows(tmp_path / "run")}
    for line in lines:
        m = re.fullmatch(r"\[350m/stem/pretrain\] step (\d+)/12 \(\d+%\) loss ([\d.]+) lr \S+ ([\d,]+) tok/s "
                         r"ETA (\d+):(\d\d):(\d\d)", line)
        assert m, line
        assert float(m.group(2)) == pytest.approx(losses[int(m.group(1))], abs=1e-4)
    assert lines[-1].endswith("ETA 0:00:00")
    assert not (tmp_path / "run" / "tensorboard").exists()   # off unless switched on


def test_progress_rates_and_eta(monkeypatch):
    clock = iter([100.0, 110.0, 130.0])
    monkeypatch.setattr("stem.train.loop.time.time", lambda: next(clock))
    p = Progress("1b/stem/extend", 20, 120, tokens_per_step=1000)   # resumed at step 20, started at t=100
    assert p.line(30, 2.5, 1e-4) == "[1b/stem/extend] step 30/120 (25%) loss 2.5000 lr 1.00e-04 1,000 tok/s ETA 0:01:30"
    # 10 more steps in 20 s: 500 tok/s over the interval; 20 steps in 30 s since the start: 80 left -> 120 s
    assert p.line(40, 2.0, 1e-4).endswith("500 tok/s ETA 0:02:00")


def test_tensorboard_off_in_tiny_on_in_paper():
    for exp, on in (("tiny", False), ("paper", True)):
        cfg = C.experiment.load(C.REPO / "config" / f"{exp}.yaml")
        assert C.train_spec(cfg, "1b", "stem", "pretrain")["train"]["tensorboard"] is on


def _scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_holds_the_metrics_and_survives_a_resume(tiny_data, tmp_path):
    spec = make_spec(tiny_data, tmp_path / "run", tensorboard=True)
    train(spec, threads=1, max_steps=6)   # states at steps 4 and 6; events for 1..6
    state = tmp_path / "run" / "_state"
    shutil.rmtree(state / "step_00000006")   # resume from step 4: steps 5 and 6 are logged again
    train(spec, threads=1)
    rows = _rows(tmp_path / "run")
    tb = _scalars(tmp_path / "run" / "tensorboard")
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "val/loss", "val/ppl"} <= set(tb)
    assert [s for s, _ in tb["train/loss"]] == list(range(1, 13))
    assert [v for _, v in tb["train/loss"]] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert [v for _, v in tb["train/lr"]] == pytest.approx([r["lr"] for r in rows], rel=1e-6)
    assert tb["val/loss"] == [(r["step"], pytest.approx(r["val_loss"], rel=1e-6)) for r in rows if "val_loss" in r]
