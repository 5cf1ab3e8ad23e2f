"""Checkpoints. Weights in safetensors; optimizer state via torch.save, read with weights_only=True.

Two kinds, in two places:
- resumable training state under ``{out_dir}/_state/`` (undeclared to Snakemake, so a failed or
  preempted job keeps it): ``step_{N}/`` folders written to a temp name and renamed, plus a
  ``latest`` pointer replaced atomically; older states are pruned. Each folder's ``manifest.json``
  (written last) lists its files' sizes: resuming skips a folder that does not match it, with a
  one-line warning naming the bad file, and takes the previous one.
- the declared final checkpoint ``{out_dir}/checkpoint/``: model.safetensors, config.json (the job
  spec, model config included), tokenizer.json, accounting.json, and ``optimizer/`` when the next stage
  carries the optimizer state (reset_optimizer: false); written to a temp folder, renamed.
  ``load_checkpoint`` builds its model; ``load_offloaded`` builds it with the tables left in the file
  (stem.models.offload).

Below training and evaluation (stem.train, stem.eval, stem.hf and stem.analysis read and write checkpoints
here), above stem.models.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from stem.io import atomic_dir, atomic_write_json, atomic_write_text
from stem.layout import IDENTITY, checkpoint_identity
from stem.models.spec import ModelConfig
from stem.models.model import build_model, loaded_state, saved_state
from stem.models.offload import dse_tables, offload, token_tables


def _state_dict_for_save(model) -> dict:
    return {k: v.detach().contiguous().cpu() for k, v in saved_state(model.state_dict(), getattr(model, "cfg", None)).items()}


def save_weights(model, path):
    save_file(_state_dict_for_save(model), str(path))


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def read_weights(path) -> dict:
    """Every tensor of a safetensors file; one ValueError line naming the file if it cannot be read."""
    if not Path(path).is_file():
        raise ValueError(f"{path}: weights file not found")
    try:
        return load_file(str(path))
    except Exception as e:  # SafetensorError on a truncated or foreign file, OSError
        raise ValueError(f"{path}: unreadable safetensors file ({type(e).__name__}: {first_line(e)})") from None


def load_weights(model, path, strict: bool = True):
    """Load a safetensors file into ``model``; any problem is one ValueError line naming the file."""
    state = loaded_state(read_weights(path), getattr(model, "cfg", None))
    own = model.state_dict()
    bad = [f"{k} {tuple(v.shape)} vs model {tuple(own[k].shape)}" for k, v in state.items()
           if k in own and v.shape != own[k].shape]
    if bad:
        raise ValueError(f"{path}: weights do not match the model's shapes ({bad[0]})")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if strict and (missing or unexpected):
        raise ValueError(f"{path}: weights do not match the model (missing {missing[:3]}, unexpected {unexpected[:3]})")


MANIFEST = "manifest.json"


def write_manifest(folder):
    """Written last into a state folder: every file's size. A folder whose files do not match it (a
    truncated copy, a full disk, a write cut short) is not resumed from."""
    folder = Path(folder)
    sizes = {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*"))
             if f.is_file() and f.name != MANIFEST}
    atomic_write_json(folder / MANIFEST, {"files": sizes})


def verify_state(folder) -> str | None:
    """None if ``folder`` is a complete state, else one line naming the bad file."""
    folder = Path(folder)
    manifest = folder / MANIFEST
    if not manifest.is_file():
        if (folder / "extra.json").is_file():
            return None  # written before manifests existed: only a failed load can tell
        return f"{manifest}: missing (the state was not completely written)"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as e:
        return f"{manifest}: unreadable ({first_line(e)})"
    for name, size in files.items():
        f = folder / name
        if not f.is_file():
            return f"{f}: missing"
        if f.stat().st_size != size:
            return f"{f}: {f.stat().st_size} bytes, expected {size} (truncated or overwritten)"
    return None


def state_candidates(state_dir) -> list[Path]:
    """State folders to resume from, best first: the one ``latest`` names, then the others, newest first."""
    state_dir = Path(state_dir)
    found = sorted((p for p in state_dir.glob("step_*") if p.is_dir()), reverse=True)
    pointer = state_dir / "latest"
    first = state_dir / pointer.read_text().strip() if pointer.is_file() else None
    return ([first] if first is not None and first.is_dir() else []) + [p for p in found if p != first]


def save_state(state_dir, step: int, model, opt, extra: dict, keep: int = 2):
    state_dir = Path(state_dir)
    with atomic_dir(state_dir / state_name(step), prefix=".tmp_") as tmp:
        save_weights(model, tmp / "model.safetensors")
        torch.save(opt.state_dict(), tmp / "optim.pt")
        atomic_write_json(tmp / "extra.json", {"step": step, **extra})
        write_manifest(tmp)
    point_latest(state_dir, step, keep)


def state_name(step: int) -> str:
    return f"step_{step:08d}"


def point_latest(state_dir, step: int, keep: int):
    """After ``step_{step}/`` is complete: point ``latest`` at it and prune all but the newest ``keep`` states."""
    state_dir = Path(state_dir)
    atomic_write_text(state_dir / "latest", state_name(step) + "\n")
    for old in sorted(state_dir.glob("step_*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def load_state(folder, model, opt) -> dict:
    """Restore the state in ``folder`` (single-process format) into model/opt; returns its extra dict."""
    folder = Path(folder)
    load_weights(model, folder / "model.safetensors")
    opt.load_state_dict(torch.load(folder / "optim.pt", weights_only=True, map_location="cpu"))
    return json.loads((folder / "extra.json").read_text())


def save_checkpoint(out_dir, model, spec: dict, tokenizer_path, accounting: dict, optimizer_dir=None):
    """``optimizer_dir``: a finished optimizer-state folder (save_optimizer) moved in as ``optimizer/``."""
    with atomic_dir(out_dir, prefix=".tmp_ckpt_") as tmp:
        save_weights(model, tmp / "model.safetensors")
        if optimizer_dir is not None:
            os.replace(optimizer_dir, tmp / "optimizer")
        atomic_write_json(tmp / "config.json", spec)
        atomic_write_json(tmp / "accounting.json", accounting)
        shutil.copyfile(tokenizer_path, tmp / "tokenizer.json")


def read_checkpoint_spec(ckpt_dir) -> dict:
    """The job spec saved in a checkpoint folder (config.json), checked to hold a model config."""
    ckpt_dir = Path(ckpt_dir)
    for name in ("config.json", "model.safetensors"):
        if not (ckpt_dir / name).is_file():
            raise ValueError(f"{ckpt_dir}: not a checkpoint folder ({name} missing)")
    path = ckpt_dir / "config.json"
    try:
        spec = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({first_line(e)})") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise ValueError(f"{path}: not a checkpoint config (expected a JSON object with a 'model' object)")
    return spec


def check_identity(ckpt_dir, saved: dict, expected: dict | None, job: str) -> None:
    """One line when the checkpoint's saved job spec (its config.json) is not the experiment/scale/variant/stage
    ``expected`` (the job's own; None: what the checkpoint's path names, ``layout.checkpoint_identity``; a path
    outside the results layout names none, and nothing is checked): e.g. a checkpoint copied into another
    variant's slot is never read as that variant's."""
    expected = expected or checkpoint_identity(ckpt_dir)
    if not expected:
        return
    wrong = [f"{k} {saved.get(k)!r} != {expected[k]!r}" for k in IDENTITY
             if k in expected and saved.get(k) != expected[k]]
    if wrong:
        have, want = ("/".join(str(d.get(k)) for k in IDENTITY) for d in (saved, expected))
        raise ValueError(f"checkpoint {Path(ckpt_dir) / 'config.json'}: not the one {job} is for (saved job {have}, "
                         f"expected {want}: {', '.join(wrong)})")


def load_checkpoint(ckpt_dir, device="cpu"):
    """(model, spec) from a checkpoint folder written by save_checkpoint."""
    ckpt_dir = Path(ckpt_dir)
    spec = read_checkpoint_spec(ckpt_dir)
    try:
        model = build_model(ModelConfig.from_dict(spec["model"]), device)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{ckpt_dir / 'config.json'}: bad model config ({first_line(e)})") from None
    load_weights(model, ckpt_dir / "model.safetensors")
    return model, spec


def load_offloaded(ckpt_dir, device="cpu", dtype=torch.float32, cache_rows: int = 0, prefetch: bool = True):
    """(model, spec) from a checkpoint folder without ever reading its tables into memory: the model is built
    on the meta device, its tables offloaded (the far tier reads model.safetensors), the rest materialised on
    ``device`` and read from the file tensor by tensor."""
    ckpt = Path(ckpt_dir)
    weights = ckpt / "model.safetensors"
    spec = read_checkpoint_spec(ckpt)
    try:
        model = build_model(ModelConfig.from_dict(spec["model"]), "meta").to(dtype)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{ckpt / 'config.json'}: bad model config ({e})") from None
    offloaded = [t for _, _, t in token_tables(model)] + [t for _, _, _, t in dse_tables(model)]
    tables = {f"{n}.weight" for n, m in model.named_modules() if any(m is t for t in offloaded)}
    offload(model, weights, device, cache_rows, prefetch)
    model.to_empty(device=device)   # a tied head is the embedding again (Transformer.to_empty), filled with it
    model.init_weights()  # the buffers not saved with the weights (RoPE frequencies); the weights come next
    own = saved_state(model.state_dict(), model.cfg)
    try:
        with safe_open(str(weights), framework="pt", device="cpu") as f:
            have = set(f.keys())
            if have != set(own) | tables:
                raise ValueError(f"{weights}: weights do not match the model (missing "
                                 f"{sorted(set(own) - have)[:3]}, unexpected {sorted(have - set(own) - tables)[:3]})")
            for k, v in own.items():
                t = f.get_tensor(k)
                if t.shape != v.shape:
                    raise ValueError(f"{weights}: {k} {tuple(t.shape)} vs model {tuple(v.shape)}")
                v.copy_(t)
    except ValueError:
        raise
    except Exception as e:  # SafetensorError (a truncated or foreign file), OSError
        msg = (str(e).strip().splitlines() or [""])[0]
        raise ValueError(f"{weights}: unreadable safetensors file ({type(e).__name__}: {msg})") from None
    return model.eval(), spec
