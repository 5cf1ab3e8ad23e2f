"""Evaluate one checkpoint on one suite and write the normalised result (``evaluate``: the eval job).

Output ``results/{experiment}/{scale}/{variant}/{stage}/eval/{suite}.json`` (written atomically)::

    {"experiment", "scale", "variant", "stage", "suite", "checkpoint", "limit",
     "harness": "lm-eval 0.4.x" | "stem.eval.niah" | "stem.eval.ppl", "fixtures": dir or null,
     "num_fewshot", "gen_kwargs", "wall_seconds",
     "tasks":  {task: {"metric": "acc_norm,none", "value": 61.2, "stderr": 2.1, "n": 40,
                       "version": 1.0, "all_metrics": {"acc,none": 58.0, "acc_stderr,none": 2.2, ...}}},
     "groups": {group: same fields (n = sum over its tasks, version = group version or null)},
     "by_length": {...},   # longbench only, see stem.eval.harness.by_length
     "cells": [{"length", "depth", "accuracy", "n"}, ...], "depth_unit": "tokens" | "sentences",  # niah only
     "truncation": {"policy": "left" | "middle" | "error", "context": max_length,
                    "tasks": {task: {"requests", "truncated", "tokens_dropped"}}}}

``truncation``: the suite's policy for requests longer than the model's context (stem.eval.lm.truncate) and, per
task, how many requests were cut and how many tokens they lost (docs/evaluation.md).

All metric values and stderrs are in percent (0-100, as the paper prints them), except a ``ppl``
suite's perplexities (``"unit": "perplexity"``). The raw lm-eval output (per-sample records
included) is kept beside it as ``eval/raw/{suite}.json``.

The suite's kind (stem.eval.spec) runs it: lm-eval tasks (stem.eval.harness), needle-in-a-haystack
(stem.eval.niah), perplexity (stem.eval.ppl); ``documents`` is the reader the last two share.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from lm_eval.utils import handle_non_serializable

from stem import layout, provenance
from stem.data.shards import content_keys, val_mask
from stem.data.sources import iter_documents
from stem.eval.lm import StemLM
from stem.eval.spec import kind_of
from stem.io import atomic_write_json, atomic_write_text
from stem.specs import EvalSpec
from stem.train.torchfloor import runtime

IDENTITY = layout.IDENTITY


def expected_job(spec: dict, out_json=None) -> dict | None:
    """What the checkpoint must be: the job spec's ``job``, else what an output path of the results layout
    ``.../results/{experiment}/{scale}/{variant}/{stage}/eval/{suite}.json`` says, else None."""
    if spec.get("job"):
        return spec["job"]
    return layout.eval_identity(out_json) if out_json else None


def _expected(spec: dict, checkpoint, out_json) -> dict | None:
    """``expected_job``, else what the checkpoint's own path names (``layout.checkpoint_identity``)."""
    if isinstance(checkpoint, (str, Path)):
        return expected_job(spec, out_json) or layout.checkpoint_identity(checkpoint)
    return expected_job(spec, out_json)


def check_job(checkpoint, saved: dict, expected: dict | None, out_json=None) -> None:
    """One-line error when the checkpoint's saved job spec is not the one this eval job is for."""
    if not expected:
        return
    wrong = [f"{k} {saved.get(k)!r} != {expected[k]!r}" for k in IDENTITY if saved.get(k) != expected[k]]
    if wrong:
        have, want = ("/".join(str(d.get(k)) for k in IDENTITY) for d in (saved, expected))
        job = f"this eval job (output {out_json})" if out_json else "this eval job"
        raise ValueError(f"checkpoint {Path(checkpoint) / 'config.json'}: saved job {have}, but {job} is for {want} "
                         f"({', '.join(wrong)})")


def documents(spec: dict, n_chars: int | None = None, n_docs: int | None = None, tok=None) -> list[str]:
    """The first documents of the suite's source (``spec["documents"]``, a reader spec), up to n_chars characters
    or n_docs documents (a tokenized source, e.g. ProLong's MDS, is decoded with ``tok``); with ``held_out``
    ({fraction, seed}: a ppl suite's ``split: val``) only its held-out documents."""
    docs, total, held = [], 0, spec.get("held_out")
    for d in iter_documents(spec["documents"]):
        d = d if isinstance(d, str) else tok.decode(d.tolist())
        if held and not val_mask(content_keys([d]), held["fraction"], held["seed"])[0]:
            continue   # a training document (the split of the tokenize rules: stem.data.shards, doc_keys content)
        docs.append(d)
        total += len(d)
        if (n_chars and total >= n_chars) or (n_docs and len(docs) >= n_docs):
            break
    return docs


# ---- one suite, end to end -------------------------------------------------------------------------------
def require_device(device: str | None):
    """A suite run for the workflow or ``python -m stem eval`` refuses a device this machine does not have, as
    training does (stem.train.loop.resolve_device): its numbers would silently come from another device.
    (lm-eval's own CLI, which asks for cuda:0 unless told otherwise, keeps stem.eval.lm.pick_device's fallback.)"""
    d = str(device or "")
    if d.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {d!r} requested but CUDA is not available on this machine (set device: cpu "
                         "or auto; evaluating elsewhere would not be the device asked for)")
    if d.startswith("mps") and not torch.backends.mps.is_available():
        raise ValueError(f"device {d!r} requested but MPS is not available on this machine (set device: cpu or auto)")


def evaluate(checkpoint, spec, out_json=None, raw_json=None, limit=None, lm=None, device=None,
             model_args: dict | None = None) -> dict:
    """``model_args``: further StemLM arguments (e.g. offload=True, cache_rows=N)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise ValueError(f"limit {limit!r}: expected a positive whole number of items per task (or no limit)")
    spec = spec.to_dict() if isinstance(spec, EvalSpec) else spec
    kind = kind_of(spec)
    spec = EvalSpec.from_dict(spec).to_dict()   # checked once; the runners read its JSON mapping
    t0 = time.time()
    if lm is None:
        require_device(device)
    lm = lm or StemLM(str(checkpoint), device=device, batch_size=spec["batch_size"], **(model_args or {}))
    check_job(checkpoint, lm.spec, _expected(spec, checkpoint, out_json), out_json)
    lm.set_truncation(spec["truncation"])
    norm, raw, harness = kind.run(lm, spec, limit)
    job = lm.spec
    result = {"experiment": job.get("experiment"), "scale": job.get("scale"), "variant": job.get("variant"),
              "stage": job.get("stage"), "suite": spec["suite"], "checkpoint": str(checkpoint), "limit": limit,
              "harness": harness, "fixtures": spec.get("fixtures"), "num_fewshot": spec.get("num_fewshot"),
              "gen_kwargs": spec.get("gen_kwargs"), **norm, "wall_seconds": round(time.time() - t0, 2)}
    result["truncation"] = {"policy": spec["truncation"], "context": lm.max_length,
                            "tasks": {spec["suite"] if t is None else t: n for t, n in lm.truncation_counts.items()}}
    ckpt_tok = Path(checkpoint) / "tokenizer.json" if isinstance(checkpoint, (str, Path)) else None
    result["provenance"] = provenance.record(spec, provenance.manifests_of(job), train_spec=job, tokenizer=ckpt_tok,
                                             data=provenance.eval_data(spec, raw))
    params = next(lm.model.parameters(), None) if hasattr(lm, "model") else None
    result["runtime"] = runtime(getattr(lm, "_device", "unknown"), params.dtype if params is not None else None,
                                requested_device=device)
    if getattr(lm, "offload", None) is not None:  # STEM tables off the device: the engine's counters
        result["offload"] = lm.offload.stats()
    if raw_json:
        Path(raw_json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(raw_json, json.dumps(raw, default=handle_non_serializable, indent=1))
    if out_json:
        atomic_write_json(out_json, result)
    return result
