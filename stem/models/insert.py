"""Mid-training insertion of STEM into a dense model (the paper's Sec. 4 "mid-training insertion"; the official
code's ``apps/main/prepare_stem_checkpoint.py``): every weight of the dense model is copied, except that in each
STEM layer i the up-projection W_up,i is dropped and the layer's table becomes

    ``projected``:  U_i = RMSNorm_i(E) W_up,i^T      (E the token embedding, V x d; RMSNorm with layer i's FFN-norm
                                                       weight and the model's eps; W_up,i the d_ff x d up-projection)
    ``raw``:        U_i = E W_up,i^T                 (no norm: the official insertion script at the commit of the
                                                       official 1B config, 128c276; RMSNorm_i arrived later)
    ``xavier``:     U_i = the STEM model's own table initialisation (xavier-normal on V x d_ff)
    ``calibrated``: U_i = the gate-weighted conditional mean of the dense layer's up-projection over each token's
                    occurrences in calibration text (stem.models.calibrate; ``calibration`` holds it)

so with ``projected`` a STEM layer first sees, for token t, the dense layer's up-projection of t's own normalised
embedding instead of that of the hidden state. (The official helper's RMSNorm uses eps 1e-6; here the model's
``norm_eps``, the eps its FFN norm runs with.)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from stem.models.model import loaded_state
from stem.options import InsertInit, values

INSERT_INITS = values(InsertInit)


def projected_table(emb: torch.Tensor, norm_weight: torch.Tensor, w_up: torch.Tensor, eps: float) -> torch.Tensor:
    """U = RMSNorm(E) W_up^T in fp32: (V, d), (d,), (d_ff, d) -> (V, d_ff)."""
    e = emb.float()
    return F.linear(F.rms_norm(e, (e.shape[-1],), norm_weight.float(), eps), w_up.float())


@torch.no_grad()
def insert_stem(model, dense_state: dict, init: str = "projected", where: str = "init_from",
                calibration=None) -> list[int]:
    """Fill ``model`` (a STEM variant: FFN kind ``stem`` in some layers) from a dense model's state dict; returns
    the STEM layers. One ValueError line naming the tensor or kind that does not fit. ``calibrated``: the tables
    from ``calibration`` (a stem.models.calibrate.Calibration of the same layers)."""
    if init not in INSERT_INITS:
        raise ValueError(f"insert_init={init!r}: expected one of {', '.join(INSERT_INITS)}")
    if init == InsertInit.CALIBRATED and calibration is None:
        raise ValueError(f"{where}: insert.init 'calibrated' without a calibration source (expected the dense "
                         "model's calibration on text: stem.models.calibrate)")
    cfg = model.cfg
    bad = sorted({k for k in cfg.ffn if k not in ("dense", "stem")})
    if bad:
        raise ValueError(f"{where}: insertion builds ffn kind 'stem' from a dense up-projection; the model has {bad}")
    layers = [i for i, k in enumerate(cfg.ffn) if k == "stem"]
    dense_state = loaded_state(dense_state, cfg)
    own = model.state_dict()
    for i in layers:   # what the insertion removes and creates
        for k in (f"layers.{i}.ffn.w_up.weight", f"layers.{i}.ffn_norm.weight", "tok_emb.weight"):
            if k not in dense_state:
                raise ValueError(f"{where}: tensor {k} missing (expected a dense checkpoint)")
    dropped = {f"layers.{i}.ffn.w_up.weight" for i in layers}
    tables = {f"layers.{i}.ffn.table.weight" for i in layers}
    for k, v in dense_state.items():
        if k in dropped or k == "dse_compress":
            continue
        if k not in own:
            raise ValueError(f"{where}: tensor {k} has no place in the {cfg.ffn.count('stem')}-STEM-layer model")
        if v.shape != own[k].shape:
            raise ValueError(f"{where}: tensor {k} {tuple(v.shape)} vs model {tuple(own[k].shape)}")
        own[k].copy_(v)
    missing = [k for k in own if k not in dense_state and k not in tables and k != "dse_compress"]
    if missing:
        raise ValueError(f"{where}: tensor {missing[0]} missing from the dense checkpoint")
    _fill_tables(own, dense_state, layers, init, cfg, calibration, where)
    return layers


def _fill_tables(own: dict, dense_state: dict, layers: list[int], init: str, cfg, calibration, where: str):
    """The tables of ``layers`` in ``own`` by ``init`` (xavier: left as the model initialised them)."""
    if init in ("projected", "raw"):
        emb = dense_state["tok_emb.weight"]
        for i in layers:
            w_up = dense_state[f"layers.{i}.ffn.w_up.weight"]
            u = (projected_table(emb, dense_state[f"layers.{i}.ffn_norm.weight"], w_up, cfg.norm_eps)
                 if init == "projected" else F.linear(emb.float(), w_up.float()))
            own[f"layers.{i}.ffn.table.weight"].copy_(u)
    elif init == InsertInit.CALIBRATED:
        everything = torch.arange(cfg.vocab_size)
        for i in layers:
            if i not in calibration.rows:
                raise ValueError(f"{where}: STEM layer {i} was not calibrated (calibrated: {sorted(calibration.rows)})")
            own[f"layers.{i}.ffn.table.weight"].copy_(calibration.table(i, everything, dense_state))
