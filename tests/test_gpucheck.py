"""`python -m stem gpucheck` (issue 22, item 1): without CUDA one line and exit 0; every item's code path at
tiny shapes on the CPU (the same functions that run at the paper's shapes on a GPU), its report files, and
item e's MFU against a hand count of the FLOPs. Issue 31: --budget (items by value, predicted costs, skips,
the report after every item), --require-mfu, and the PyTorch features checked before anything runs."""
import json

import pytest

from stem import gpucheck
from stem.__main__ import main
from stem.train import torchfloor


def test_without_cuda_one_line_and_exit_0(capsys):
    with pytest.raises(SystemExit) as e:
        main(["gpucheck"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("gpucheck: no CUDA device on this machine")


def test_unknown_item_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        main(["gpucheck", "--tiny", "--device", "cpu", "--items", "az"])
    assert e.value.code == 1
    assert capsys.readouterr().err.strip() == "error: --items az: unknown item(s) z (expected letters of abcdefg)"


def test_every_item_runs_at_tiny_shapes_on_the_cpu(tmp_path):
    lines = []
    r = gpucheck.run("cpu", tiny=True, items=gpucheck.ITEMS, out_dir=tmp_path, peak_tflops=1.0, compile=False,
                     log=lines.append, variants=("dense", "stem", "moe"))
    # each item: its predicted cost, then its result
    assert [x.split(".")[0] for x in lines] == [f"gpucheck {k}" for k in gpucheck.ITEMS for _ in range(2)]
    assert all(": predicted " in x for x in lines[::2]) and all(": PASS (" in x for x in lines[1::2]), "\n".join(lines)
    saved = json.loads((tmp_path / "gpucheck.json").read_text())
    assert saved["device"] == "cpu" and saved["shapes"] == "tiny" and set(saved["items"]) == set(gpucheck.ITEMS)
    assert saved["torch"] and all(it["ok"] for it in saved["items"].values())
    assert saved["provenance"]["versions"]["torch"] and "commit" in saved["provenance"]   # issue 32
    md = (tmp_path / "gpucheck.md").read_text()
    assert md.startswith("# GPU check (tiny shapes") and md.count("| pass |") == 7
    # a: every group of every variant trained; c: the resumed step equals the uninterrupted one
    assert all(not v["groups_without_gradient"] for v in r["items"]["a"]["details"].values())
    assert r["items"]["c"]["details"]["resumed_loss"] == pytest.approx(r["items"]["c"]["details"]["reference"][-1])
    # e: FLOPs per token of the tiny dense 350M arch (d 64, 3 layers, 4 heads of 16, 2 KV heads, d_ff 96,
    # V 512) at seq 64, by hand: matrix products 6 x (3 x (attn 3 x 4096 + SwiGLU 3 x 64 x 96 + norms 128)
    # + final norm 64 + head 512 x 64) + attention 12 x 3 x 4 x 16 x 64
    hand = 6 * (3 * (3 * 4096 + 3 * 64 * 96 + 128) + 64 + 512 * 64) + 12 * 3 * 4 * 16 * 64
    dense = [p for p in r["items"]["e"]["details"]["points"] if p["variant"] == "dense" and p["scale"] == "350m"][0]
    assert dense["flops_per_token"] == hand
    assert dense["mfu"] == pytest.approx(hand * dense["tokens_per_s"] / 1e12)
    # --require-mfu judges these points: met at a floor below the dense 1B MFU, missed above it
    points = r["items"]["e"]["details"]["points"]
    mfu_1b = [p for p in points if p["variant"] == "dense" and p["scale"] == "1b"][0]["mfu"]
    assert gpucheck.mfu_target(points, 1.0, mfu_1b / 2)[0] is True
    assert gpucheck.mfu_target(points, 1.0, min(1.0, mfu_1b * 2))[0] is False
    assert gpucheck.mfu_target(points, None)[0] is None


def test_budget_runs_by_value_skips_what_would_not_fit_and_rewrites_the_report(tmp_path):
    """Value order (a before e, whatever --items says); e's four compiled models alone are predicted at 4 x
    FIXED_S['cpu']['compiled'] s > the 30 s budget: skipped with one line; the JSON holds every finished item
    when the next one starts (a run killed then keeps them) and says when the run finished."""
    lines, seen = [], []

    def log(line):
        lines.append(line)
        f = tmp_path / "gpucheck.json"
        seen.append(json.loads(f.read_text()) if f.exists() else None)
    r = gpucheck.run("cpu", tiny=True, items="ea", out_dir=tmp_path, log=log, variants=("dense",), budget=30)
    assert [x.split(":")[0] for x in lines] == ["gpucheck a. bf16 training, every variant"] * 2 + [
        "gpucheck e. throughput and MFU"]
    assert lines[0].startswith("gpucheck a. bf16 training, every variant: predicted ") and ": PASS (" in lines[1]
    assert lines[2].startswith("gpucheck e. throughput and MFU: SKIPPED (predicted ") and "of the 30 s budget left" in lines[2]
    assert seen[0] is None and list(seen[2]["items"]) == ["a"] and not seen[2]["finished"]   # a's figure before e
    saved = json.loads((tmp_path / "gpucheck.json").read_text())
    assert saved["finished"] and saved["budget_s"] == 30 and list(saved["items"]) == ["a", "e"]
    e = saved["items"]["e"]
    assert e["ok"] is None and "seconds" not in e and e["predicted_s"] > 4 * gpucheck.FIXED_S["cpu"]["compiled"]
    assert saved["items"]["a"]["ok"] and 0 < saved["items"]["a"]["predicted_s"] < 30
    md = (tmp_path / "gpucheck.md").read_text()
    assert "| e | throughput and MFU | skipped |" in md and "budget 30 s" in md
    assert r["items"] == saved["items"]


def test_torch_features_checked_before_anything_runs(capsys, monkeypatch, tmp_path):
    """Every feature of the GPU path is present in this torch (a check that looks in the wrong place fails
    here); a torch lacking one is one line naming it and the release that has it, and nothing runs."""
    assert torchfloor.missing() == []
    monkeypatch.setattr(torchfloor, "FEATURES", torchfloor.FEATURES + [
        ("a later attention API", "torch.nn.attention.no_such_api", "99.0",
         lambda: torchfloor._attr("torch.nn.attention", "no_such_api") is not None)])
    with pytest.raises(SystemExit) as e:
        main(["gpucheck", "--tiny", "--device", "cpu", "--out", str(tmp_path)])
    assert e.value.code == 1
    out = capsys.readouterr()
    assert out.out == "" and not list(tmp_path.iterdir())
    assert out.err.strip() == (f"error: torch {torch_version()} lacks a later attention API "
                               "(torch.nn.attention.no_such_api): torch >= 99.0 has it")


def torch_version() -> str:
    import torch
    return torch.__version__
