"""The held-out loss of a mid-training insertion at step 0 (issue 30; docs/real.md): a dense checkpoint (e.g. the
imported SmolLM2) with STEM inserted (stem.models.insert) at each placement by each table init, before any
training, against the dense model itself, on the same held-out windows (``val_windows`` of a source's
validation split, as the ``heldout`` analysis reads them).

    python -m stem insertion-step0 CHECKPOINT MANIFEST OUT.json [--placements 1/3,1/2 --inits projected,raw,xavier]

Memory: one inserted model at a time, and of each table only the rows the windows read (their distinct tokens): a
forward reads no other row, so the losses are those of the whole tables (``projected`` / ``raw`` exactly; ``xavier``'s
rows are drawn from the table's own distribution, std sqrt(2 / (V + d_ff)), not the same numbers as a full table
drawn from the seed). Whole tables would be n_stem x V x d_ff fp32: SmolLM2 at 1/3, 10 x 49,152 x 1,536 = 3.0 GB;
full, 8.7 GB; the rows of 4 windows of 256 tokens: ~600 of them, ~3.7 MB a layer.

The workflow's analysis ``insertion_step0`` (config ``analysis.insertion_step0``: source, windows, seq_len,
placements, inits, calibration) runs it on a dense checkpoint (config/real.yaml: the imported SmolLM2).

Init ``calibrated`` (stem.models.calibrate): the tables from the dense model's activations on ``calibration.tokens``
tokens of the source's train split (windows of ``seq_len``, evenly spaced; a manifest of the same tokenizer),
unseen tokens by ``calibration.unseen``; ``sequential`` calibrates each placement layer after layer; ``per_layer``
adds rows ``layer i`` (only layer i inserted, calibrated) for every STEM layer of the placements (true) or of the
placements it lists: the decomposition; ``compare`` (placement names) adds there the rows of the other choices of
init calibrated (unseen mean / raw x sequential or not; key ``choice`` of the row), which ``make real`` picks from.
The output's ``calibration`` records the rows calibrated and the share of held-out tokens they cover.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from stem.analysis.common import load, manifest_dir, val_windows
from stem.models.calibrate import UNSEEN, Calibration, calibrate
from stem.models.spec import resolve_placement
from stem.models.insert import INSERT_INITS, insert_stem, projected_table
from stem.models.offload import token_tables
from stem.models.model import build_model
from stem.train.calibration import calibration_windows  # noqa: F401 (the step-0 windows; re-exported)

# the paper's placements (config/variants.yaml: stem, stem_half, stem_full)
PLACEMENTS = {"1/3": {"every": 3, "offset": 2}, "1/2": {"every": 2, "offset": 1}, "full": {"start": 1}}


@torch.no_grad()
def window_losses(model, x: torch.Tensor, batch: int = 4) -> list[float]:
    """Each window's mean next-token loss (fp32)."""
    out = []
    for b in range(0, len(x), batch):
        xb = x[b:b + batch]
        logits = model(xb[:, :-1]).float()
        out += F.cross_entropy(logits.transpose(1, 2), xb[:, 1:], reduction="none").mean(dim=1).tolist()
    return out


def step0(ckpt_dir, manifest, seq_len: int = 256, windows: int = 8, placements=("1/3", "1/2"),
          inits=INSERT_INITS, seed: int = 0, calibration: dict | None = None) -> dict:
    """{"rows": [{placement, init, stem_layers, mean_loss, delta_vs_dense, window_loss}], ...}; the first row is the
    dense model. ``placements``: names of ``PLACEMENTS`` or {name: placement spec}. ``calibration``: init
    ``calibrated``'s settings ({tokens, unseen, sequential, per_layer, manifest}; manifest: ``manifest``'s train
    split by default)."""
    manifest_dir(manifest)   # a wrong manifest is named before the model loads
    dense, _, _ = load(ckpt_dir, "cpu")
    starts, x = val_windows(manifest, min(seq_len, dense.cfg.max_seq_len) + 1, windows)
    cal = None
    if "calibrated" in inits:
        cal = dict(calibration or {}, x=calibration_windows(manifest, (calibration or {}).get("manifest"),
                                                            (calibration or {}).get("tokens", 16384),
                                                            int(x.shape[1] - 1), dense.cfg.vocab_size))
    out = {"checkpoint": str(ckpt_dir), "manifest": str(manifest), "seq_len": int(x.shape[1] - 1),
           "windows": len(starts), "starts": starts.tolist(), "seed": seed}
    out["rows"] = step0_rows(dense, x, placements, inits, seed, str(ckpt_dir), cal)
    if cal is not None:
        out["calibration"] = cal["record"]
    return out


def run(ckpt_dir, spec: dict) -> dict:
    """The workflow's analysis ``insertion_step0`` of a dense checkpoint (config ``analysis.insertion_step0``)."""
    out = step0(ckpt_dir, spec["manifest"], spec["seq_len"], spec["windows"], spec["placements"], spec["inits"],
                spec.get("seed", 0), spec.get("calibration"))
    return {"analysis": "insertion_step0", "source": spec["source"], **out}


def _named(placements) -> dict:
    named = dict(placements) if isinstance(placements, dict) else {}
    for p in placements if not named else ():
        if p not in PLACEMENTS:
            raise ValueError(f"placement {p!r}: expected one of {', '.join(PLACEMENTS)}")
        named[p] = PLACEMENTS[p]
    return named


def step0_rows(dense, x: torch.Tensor, placements=("1/3", "1/2"), inits=INSERT_INITS, seed: int = 0,
               where: str = "dense model", cal: dict | None = None) -> list[dict]:
    """The rows of ``step0`` for a loaded dense model (eval mode) and held-out windows ``x`` (B, T + 1); ``cal``:
    init ``calibrated``'s settings and windows (key ``x``); its record is written to its key ``record``."""
    bad = [i for i in inits if i not in INSERT_INITS]
    if bad:
        raise ValueError(f"insertion init {bad[0]!r}: expected one of {', '.join(INSERT_INITS)}")
    named = {name: resolve_placement(spec, dense.cfg.n_layers) for name, spec in _named(placements).items()}
    if "calibrated" in inits and cal is None:
        raise ValueError("insertion init 'calibrated' without a calibration source (expected calibration windows)")
    rows = [{"placement": "dense", "init": None, "stem_layers": [], "window_loss": window_losses(dense, x)}]
    state = dense.state_dict()
    shared = _calibrate(dense, cal, sorted({i for v in named.values() for i in v}), x) if cal else None
    seqs = {}   # (placement, layers) -> its sequential calibration, shared by the unseen rules
    for name, layers, init, choice in _runs(named, inits, cal):
        cfg = dataclasses.replace(dense.cfg, ffn=tuple("stem" if i in layers else "dense"
                                                       for i in range(dense.cfg.n_layers)))
        calib = None
        if init == "calibrated":
            unseen, seq = choice or (cal.get("unseen", "mean"), bool(cal.get("sequential")))
            if seq and len(layers) > 1 and name not in seqs:
                seqs[name] = _calibrate(dense, {**cal, "sequential": True}, layers, x)
            calib = (seqs[name] if seq and len(layers) > 1 else shared).with_unseen(unseen)
        model = inserted_rows(cfg, state, init, x.unique(), seed, where, calib)
        rows.append({"placement": name, "init": init, "stem_layers": layers, "window_loss": window_losses(model, x),
                     **({"choice": {"unseen": choice[0], "sequential": choice[1]}} if choice else {})})
        del model
    for r in rows:
        r["mean_loss"] = sum(r["window_loss"]) / len(r["window_loss"])
        r["delta_vs_dense"] = r["mean_loss"] - rows[0]["mean_loss"]
    return rows


def _runs(named: dict, inits, cal: dict | None) -> list[tuple]:
    """(placement, layers, init, choice) of each row after the dense one: every placement x init; with ``cal``'s
    ``compare`` (placement names), init calibrated's other choices (unseen rule x sequential) there, choice = (unseen,
    sequential); with ``per_layer`` (true: every STEM layer of the placements; a list: those placements'), one
    calibrated STEM layer at a time, the decomposition (choice None: the configured one)."""
    runs = [(name, layers, init, None) for name, layers in named.items() for init in inits]
    cal = cal or {}
    primary = (cal.get("unseen", "mean"), bool(cal.get("sequential")))
    for name in cal.get("compare") or ():
        if name not in named:
            raise ValueError(f"calibration.compare: placement {name!r} is not one of the placements "
                             f"({', '.join(named)})")
        runs += [(name, named[name], "calibrated", (u, s)) for u in UNSEEN for s in (False, True) if (u, s) != primary]
    per = cal.get("per_layer")
    for name in per if isinstance(per, (list, tuple)) else ():
        if name not in named:
            raise ValueError(f"calibration.per_layer: placement {name!r} is not one of the placements "
                             f"({', '.join(named)})")
    keep = named if per is True else {n: named[n] for n in per} if isinstance(per, (list, tuple)) else {}
    runs += [(f"layer {i}", [i], "calibrated", None) for i in sorted({i for v in keep.values() for i in v})]
    return runs


class TableRows(nn.Module):
    """A STEM table that holds only the rows of ``ids``: looking up id ``ids[k]`` gives ``rows[k]``; any other id is
    an IndexError (a forward on other tokens than those the rows were built for)."""

    def __init__(self, ids: torch.Tensor, rows: torch.Tensor, vocab_size: int):
        super().__init__()
        index = torch.full((vocab_size,), len(ids), dtype=torch.long)   # past the end: not built
        index[ids] = torch.arange(len(ids))
        self.register_buffer("index", index, persistent=False)
        self.register_buffer("rows", rows, persistent=False)

    def forward(self, ids):
        return self.rows[self.index[ids]]


def _calibrate(dense, cal: dict, layers: list[int], x: torch.Tensor) -> Calibration:
    """``layers`` calibrated on ``cal["x"]``; the record (rows, held-out coverage, CPU seconds) in ``cal["record"]``."""
    t0 = time.process_time()
    out = calibrate(dense, cal["x"], layers, cal.get("unseen", "mean"), bool(cal.get("sequential")))
    rec = cal.setdefault("record", {"tokens": int(cal["x"].numel()), "unseen": cal.get("unseen", "mean"),
                                    "sequential": bool(cal.get("sequential")), "rows_calibrated": len(out.ids),
                                    "vocab_size": dense.cfg.vocab_size, "heldout_coverage": out.coverage(x[:, :-1]),
                                    "cpu_seconds": {}})
    rec["cpu_seconds"][",".join(map(str, layers)) + (" sequential" if cal.get("sequential") else "")] = \
        round(time.process_time() - t0, 1)
    print(f"calibrated layers {layers}: {len(out.ids):,} rows of {dense.cfg.vocab_size:,}, covering "
          f"{rec['heldout_coverage']:.1%} of the held-out lookups (the windows' input tokens)")
    return out


@torch.no_grad()
def inserted_rows(cfg, dense_state: dict, init: str, ids: torch.Tensor, seed: int = 0, where: str = "dense model",
                  calibration: Calibration | None = None):
    """The STEM model ``cfg`` inserted into ``dense_state`` by ``init`` (stem.models.insert), its tables holding only
    the rows of token ids ``ids`` (eval mode, CPU): every other weight is the dense model's, bit for bit."""
    model = build_model(cfg, "meta")
    found = token_tables(model)
    for parent, attr, _ in found:
        setattr(parent, attr, nn.Identity())   # placeholders: the rows come after the copy below
    model.to_empty(device="cpu")   # tied again, if tied (Transformer.to_empty)
    model.init_weights()   # the buffers not in a state dict (RoPE frequencies)
    layers = insert_stem(model, dense_state, "xavier", where)   # every weight but the tables (xavier: none set)
    emb = dense_state["tok_emb.weight"][ids]
    gen = torch.Generator().manual_seed(seed)
    for (parent, attr, _), i in zip(found, layers):
        w_up = dense_state[f"layers.{i}.ffn.w_up.weight"]
        if init == "calibrated":
            if calibration is None:
                raise ValueError(f"{where}: insertion init 'calibrated' without a calibration source")
            u = calibration.table(i, ids, dense_state)
        elif init == "projected":
            u = projected_table(emb, dense_state[f"layers.{i}.ffn_norm.weight"], w_up, cfg.norm_eps)
        elif init == "raw":
            u = F.linear(emb.float(), w_up.float())
        else:   # xavier-normal on the V x d_ff table (StemTable's init): these rows of it
            u = torch.randn(len(ids), cfg.d_ff, generator=gen) * math.sqrt(2.0 / (cfg.vocab_size + cfg.d_ff))
        setattr(parent, attr, TableRows(ids, u, cfg.vocab_size))
    return model.eval()
