"""Checkpoints. Weights in safetensors; optimizer state via torch.save, read with weights_only=True.

Two kinds, in two places:
- resumable training state under ``{out_dir}/_state/`` (undeclared to Snakemake, so a failed or
  preempted job keeps it): ``step_{N}/`` folders written to a temp name and renamed, plus a
  ``latest`` pointer replaced atomically; older states are pruned.
- the declared final checkpoint ``{out_dir}/checkpoint/``: model.safetensors, config.json (the job
  spec, model config included), tokenizer.json, accounting.json; written to a temp folder, renamed.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def atomic_write_text(path, text: str):
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp creates 0600; a result file is as readable as any other
    os.replace(tmp, path)


def atomic_write_json(path, obj):
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _state_dict_for_save(model) -> dict:
    return {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}


def save_weights(model, path):
    save_file(_state_dict_for_save(model), str(path))


def load_weights(model, path, strict: bool = True):
    state = load_file(str(path))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if strict and (missing or unexpected):
        raise ValueError(f"{path}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")


def _replace_dir(tmp: Path, final: Path):
    old = final.with_name(final.name + ".old")
    if final.exists():
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def save_state(state_dir, step: int, model, opt, extra: dict, keep: int = 2):
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=state_dir, prefix=".tmp_"))
    save_weights(model, tmp / "model.safetensors")
    torch.save(opt.state_dict(), tmp / "optim.pt")
    atomic_write_json(tmp / "extra.json", {"step": step, **extra})
    _replace_dir(tmp, state_dir / f"step_{step:08d}")
    atomic_write_text(state_dir / "latest", f"step_{step:08d}\n")
    for old in sorted(state_dir.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_state(state_dir, model, opt) -> dict | None:
    """Restore the latest state into model/opt; returns its extra dict, or None if there is none."""
    pointer = Path(state_dir) / "latest"
    if not pointer.is_file():
        return None
    folder = Path(state_dir) / pointer.read_text().strip()
    load_weights(model, folder / "model.safetensors")
    opt.load_state_dict(torch.load(folder / "optim.pt", weights_only=True, map_location="cpu"))
    return json.loads((folder / "extra.json").read_text())


def save_checkpoint(out_dir, model, spec: dict, tokenizer_path, accounting: dict):
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=".tmp_ckpt_"))
    save_weights(model, tmp / "model.safetensors")
    atomic_write_json(tmp / "config.json", spec)
    atomic_write_json(tmp / "accounting.json", accounting)
    shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")
    _replace_dir(tmp, out_dir)


def load_checkpoint(ckpt_dir, device="cpu"):
    """(model, spec) from a checkpoint folder written by save_checkpoint."""
    from stem.models.config import ModelConfig

    ckpt_dir = Path(ckpt_dir)
    for name in ("config.json", "model.safetensors"):
        if not (ckpt_dir / name).is_file():
            raise ValueError(f"{ckpt_dir}: not a checkpoint folder ({name} missing)")
    spec = json.loads((ckpt_dir / "config.json").read_text())
    model = ModelConfig.from_dict(spec["model"]).build(device)
    load_weights(model, ckpt_dir / "model.safetensors")
    return model, spec
