"""Init ``calibrated`` on the training path (issue 41, docs/real.md): the train job that inserts STEM into a dense
checkpoint first calibrates the tables from the dense model's own activations (stem.models.calibrate) on windows of
its calibration source's train split (``insert.calibration``: the stage's first source by default), then inserts
and trains as with any other init. The record (tokens, rows calibrated of the vocabulary, the share of the stage's
held-out lookups they cover, the running sums' memory bound, CPU seconds) goes into the job's summary.json
(``insertion``). ``calibration_windows`` is also the step-0 analysis's (stem.analysis.insertion).
"""
from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from stem.data.shards import ShardSet
from stem.models.calibrate import Calibration, calibrate
from stem.models.model import build_model, loaded_state
from stem.train.entity_text import entity_windows


def calibration_windows(manifest, source, tokens: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    """Windows of ``seq_len`` tokens, ``tokens`` in all, evenly spaced over the train split of ``source`` (a
    manifest; default ``manifest``), which must be tokenised as ``manifest`` is (same tokenizer hash and vocab)."""
    source = Path(source or manifest)
    if not source.is_file():
        raise ValueError(f"calibration.manifest: {source}: no such file (expected a tokens manifest.json)")
    want, have = (json.loads(Path(m).read_text()) for m in (manifest, source))
    for key in ("tokenizer_sha256", "vocab_size"):
        if have.get(key) != want.get(key):
            raise ValueError(f"calibration.manifest: {source}: {key} {have.get(key)!r}, expected {want.get(key)!r} "
                             f"(the tokenizer of {manifest})")
    if int(have["vocab_size"]) != vocab_size:
        raise ValueError(f"calibration.manifest: {source}: vocab_size {have['vocab_size']}, expected the model's "
                         f"{vocab_size}")
    if source.name != "manifest.json":   # the shards are read from its folder's manifest.json
        raise ValueError(f"calibration.manifest: {source}: not a token-shard manifest (expected the manifest.json of "
                         f"a tokenize stage's folder)")
    if not isinstance(tokens, int) or tokens < seq_len:
        raise ValueError(f"calibration.tokens: {tokens!r}; expected a whole number >= seq_len {seq_len}")
    shards = ShardSet(source.parent, "train")
    n = min(tokens // seq_len, len(shards) // seq_len)
    if n < 1:
        raise ValueError(f"calibration.manifest: {source}: train split has {len(shards)} tokens, fewer than one "
                         f"window of {seq_len}")
    return torch.from_numpy(shards.windows(seq_len, n)[1])


def heldout_tokens(manifest) -> torch.Tensor:
    """Every token of ``manifest``'s held-out (val) split (empty without one)."""
    shards = ShardSet(Path(manifest).parent, "val")
    n = len(shards)
    return torch.from_numpy(np.asarray(shards.get(0, n), dtype=np.int64)) if n else torch.zeros(0, dtype=torch.long)


def best_choice(step0, layers: list[int]) -> dict:
    """The choice of init calibrated (unseen rule, sequential) with the lowest held-out loss among the calibrated
    rows of the step-0 analysis ``step0`` (stem.analysis.insertion) at exactly the STEM layers ``layers``:
    {unseen, sequential, step0, heldout_loss, compared: [{unseen, sequential, heldout_loss}]}."""
    try:
        d = json.loads(Path(step0).read_text())
        primary = {"unseen": d["calibration"]["unseen"], "sequential": d["calibration"]["sequential"]}
        rows = [{**(r.get("choice") or primary), "heldout_loss": r["mean_loss"]} for r in d["rows"]
                if r["init"] == "calibrated" and list(r["stem_layers"]) == list(layers)]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"insert.calibration.step0: {step0}: {type(e).__name__}: {e} (expected the insertion_step0 "
                         f"analysis JSON)") from None
    if not rows:
        raise ValueError(f"insert.calibration.step0: {step0}: no calibrated row at STEM layers {layers} (expected a "
                         f"placement of analysis.insertion_step0 with exactly these layers)")
    best = min(rows, key=lambda r: r["heldout_loss"])
    return {**best, "step0": str(step0), "compared": rows}


def calibrate_insertion(model_cfg, dense_state: dict, cal: dict, manifest, seq_len: int,
                        log=print) -> tuple[Calibration, dict]:
    """The calibration of the STEM layers of ``model_cfg`` (a STEM model's config) from the dense weights
    ``dense_state``, on ``cal`` = {manifest, tokens, unseen, sequential} (manifest: the calibration source's; None:
    ``manifest``'s train split); returns it and its record (the summary's ``insertion``)."""
    t0 = time.process_time()
    layers = [i for i, k in enumerate(model_cfg.ffn) if k == "stem"]
    choice = best_choice(cal["step0"], layers) if cal.get("step0") else None
    if choice:
        cal = {**cal, "unseen": choice["unseen"], "sequential": choice["sequential"]}
        log(f"calibration choice from {choice['step0']}: unseen {choice['unseen']}, sequential "
            f"{choice['sequential']} (step-0 held-out loss {choice['heldout_loss']:.3f}, the lowest of "
            f"{len(choice['compared'])})")
    dense_cfg = dataclasses.replace(model_cfg, ffn=tuple("dense" for _ in model_cfg.ffn))
    x = calibration_windows(manifest, cal.get("manifest"), int(cal["tokens"]), seq_len, model_cfg.vocab_size)
    dense = build_model(dense_cfg, "cpu")
    dense.load_state_dict(loaded_state(dense_state, dense_cfg))
    dense.eval()
    ents, ent_rec = entity_windows(cal["entities"]["out"]) if cal.get("entities") else ([], None)
    out = calibrate(dense, [x, *ents], layers, cal.get("unseen", "mean"), bool(cal.get("sequential")), log=log)
    del dense
    held = heldout_tokens(manifest)
    rec = {"init": "calibrated", "source": cal.get("source"), "manifest": str(cal.get("manifest") or manifest),
           "tokens": int(x.numel()), "windows": int(x.shape[0]), "seq_len": seq_len,
           "unseen": cal.get("unseen", "mean"), "sequential": bool(cal.get("sequential")), "stem_layers": layers,
           "rows_calibrated": len(out.ids), "vocab_size": model_cfg.vocab_size,
           "heldout_tokens": int(held.numel()), "heldout_coverage": out.coverage(held) if held.numel() else None,
           "memory_bound_bytes": len(layers) * len(out.ids) * model_cfg.d_ff * 8,
           "cpu_seconds": round(time.process_time() - t0, 1), **({"choice": choice} if choice else {}),
           **({"entities": entity_record(ent_rec, ents, x, out)} if ent_rec else {})}
    cover = "no held-out split" if rec["heldout_coverage"] is None else \
        f"covering {rec['heldout_coverage']:.1%} of the {rec['heldout_tokens']:,} held-out lookups"
    log(f"calibrated STEM layers {layers} on {rec['tokens']:,} tokens: {rec['rows_calibrated']:,} rows of "
        f"{rec['vocab_size']:,}, {cover}; running sums {rec['memory_bound_bytes'] / 2 ** 20:,.1f} MiB; "
        f"{rec['cpu_seconds']} CPU-s")
    if ent_rec:
        e = rec["entities"]
        log(f"entity texts: {e['texts_tokens']:,} tokens, {e['rows_added']:,} rows the source did not calibrate; "
            f"entities whose row is calibrated: {e['entity_rows_calibrated']} of {e['entities']} "
            f"({e['entity_rows_in_source']} from the source alone)")
    return out, rec


def entity_record(rec: dict, ents: list, source: torch.Tensor, out: Calibration) -> dict:
    """What the entity texts (stem.train.entity_text) added: their tokens, the rows they calibrated that the
    source's windows did not, and per entity (its first token in the texts' prompts) whether its row is calibrated
    with and without them."""
    from_source = set(source.reshape(-1).tolist())
    ent_ids = set(torch.cat([e.reshape(-1) for e in ents]).tolist()) if ents else set()
    names = rec["entity_ids"]   # name -> its token ids as the prompts write it (" Spain")
    return {"texts_tokens": rec["tokens"], "spec": rec["spec"], "generation_cpu_seconds": rec["cpu_seconds"],
            "rows_added": len(ent_ids - from_source), "entities": len(names),
            "entity_rows_calibrated": sum(all(out.index[t] >= 0 for t in ids) for ids in names.values()),
            "entity_rows_in_source": sum(all(t in from_source for t in ids) for ids in names.values())}
