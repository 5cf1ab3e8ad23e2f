"""`python -m stem gpucheck` (issue 22, item 1): without CUDA one line and exit 0; every item's code path at
tiny shapes on the CPU (the same functions that run at the paper's shapes on a GPU), its report files, and
item e's MFU against a hand count of the FLOPs."""
import json

import pytest

from stem import gpucheck
from stem.__main__ import main


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
    assert [x.split(".")[0] for x in lines] == [f"gpucheck {k}" for k in gpucheck.ITEMS]
    assert all(": PASS (" in x for x in lines), "\n".join(lines)
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
