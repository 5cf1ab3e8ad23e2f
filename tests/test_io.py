"""stem.io: the one atomic-write helper every writer uses (a failed write leaves the old output and no temp)."""
import os
import stat

import pytest
import torch

from stem.io import atomic_dir, atomic_open, atomic_path, atomic_write_json, replace_dir, umask
from stem import checkpoint as ck


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_files_replace_whole_with_plain_modes(tmp_path):
    out = tmp_path / "a" / "b.json"
    atomic_write_json(out, {"b": 1, "a": [2]})
    assert out.read_text() == '{\n  "a": [\n    2\n  ],\n  "b": 1\n}\n'
    assert _mode(out) == 0o666 & ~umask()          # not mkstemp's 0600
    with atomic_path(out) as tmp:                   # a writer that takes a path
        tmp.write_bytes(b"new")
        assert out.read_text().startswith("{")      # the old file stays until the block ends
    assert out.read_bytes() == b"new" and os.listdir(out.parent) == ["b.json"]


def test_failed_write_keeps_the_old_file_and_leaves_no_temp(tmp_path):
    out = tmp_path / "x.txt"
    out.write_text("old")
    with pytest.raises(RuntimeError, match="cut"):
        with atomic_open(out, "w", fsync=True) as f:
            f.write("half")
            raise RuntimeError("cut")
    assert out.read_text() == "old" and os.listdir(tmp_path) == ["x.txt"]


def test_dirs_replace_an_existing_folder_and_a_failed_fill_leaves_nothing(tmp_path):
    dst = tmp_path / "d"
    with atomic_dir(dst) as tmp:
        (tmp / "f").write_text("1")
    assert _mode(dst) == 0o777 & ~umask() and (dst / "f").read_text() == "1"
    with pytest.raises(OSError):
        with atomic_dir(dst) as tmp:
            (tmp / "g").write_text("2")
            raise OSError("disk full")
    assert sorted(os.listdir(tmp_path)) == ["d"] and os.listdir(dst) == ["f"]
    src = tmp_path / "new"
    src.mkdir()
    (src / "h").write_text("3")
    (tmp_path / "d.old").mkdir()                    # a leftover the old checkpoint helper tripped over
    (tmp_path / "d.old" / "junk").write_text("")
    replace_dir(src, dst)
    assert os.listdir(dst) == ["h"] and not src.exists()


def test_a_failed_checkpoint_leaves_the_previous_one_and_no_temp(tmp_path):
    model = torch.nn.Linear(2, 2)
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    ckpt = tmp_path / "run" / "checkpoint"
    ck.save_checkpoint(ckpt, model, {"model": {}}, tok, {"total_params": 6})
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(FileNotFoundError):
        ck.save_checkpoint(ckpt, model, {"model": {}}, tmp_path / "missing.json", {"total_params": 6})
    assert os.listdir(ckpt.parent) == ["checkpoint"]   # the old helper left .tmp_ckpt_* behind
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before


def test_states_point_latest_at_the_newest_and_keep_two(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    for step in (1, 2, 3):
        ck.save_state(tmp_path, step, model, opt, {"loader": {}})
    assert sorted(os.listdir(tmp_path)) == ["latest", "step_00000002", "step_00000003"]
    assert (tmp_path / "latest").read_text() == "step_00000003\n"
    assert ck.state_candidates(tmp_path) == [tmp_path / "step_00000003", tmp_path / "step_00000002"]
