"""Run one analysis on one checkpoint and write its JSON atomically (nothing is written on an error)."""
from __future__ import annotations

import time
from pathlib import Path

from stem import provenance
from stem.analysis.common import TINY_NOTE
from stem.checkpoint import check_identity, read_checkpoint_spec
from stem.io import atomic_write_json
from stem.registry import ANALYSES, resolve

IDENTITY = ("experiment", "scale", "variant", "stage")


def analyze(ckpt_dir, spec: dict, out_json) -> dict:
    name = spec.get("analysis")
    if name not in ANALYSES:
        raise ValueError(f"analysis spec: key 'analysis' is {name!r}; expected one of {', '.join(ANALYSES)}")
    saved = read_checkpoint_spec(ckpt_dir)
    check_identity(ckpt_dir, saved, spec.get("job"), "this analysis job")
    t0 = time.time()
    result = resolve(ANALYSES[name].run)(ckpt_dir, spec)
    out = {**{k: saved.get(k) for k in IDENTITY}, **result, "spec": spec,
           "wall_seconds": round(time.time() - t0, 2),
           "provenance": provenance.record(spec, provenance.manifests_of(saved), train_spec=saved,
                                           tokenizer=Path(ckpt_dir) / "tokenizer.json")}
    if saved.get("experiment") == "tiny":
        out["label"] = TINY_NOTE
    atomic_write_json(out_json, out)
    return out
