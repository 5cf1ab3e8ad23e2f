"""The DSE paper's Sec. 3 sweeps (Fig. 2), as generated variants of the experiment's own training jobs.

- ``rho`` (Sec. 3.1, Fig. 2 left, sparsity allocation): P_tot = trainable parameters without the token
  embedding and the LM head, P_act = those used per token, P_free = P_tot - P_act. rho is the fraction of
  P_free in routed MoE experts (rho = 1: the pure MoE model ``sweeps.rho.base``). For each rho the hybrid keeps
  E' = k + round(rho (E - k)) routed experts (k = top-k, E the base's experts: the routed experts' inactive
  part is rho P_free) and gets the DSE memory of ``sweeps.rho.memory`` with the table rows that bring its
  P_tot nearest the base's. P_act then differs from the base's by the memory's projections, convolution and
  norms (which run per token) less the removed experts' router columns; both deviations are recorded and
  must be within ``sweeps.rho.tolerance``.
- ``slots`` (Sec. 3.2, Fig. 2 right, memory scaling): the backbone ``sweeps.slots.base`` with the DSE memory
  of ``sweeps.slots.memory`` at each ``rows_per_head`` (each table has the first prime >= it rows, as
  stem.models.dse builds it); M = the memory's slots, every table row of every DSE layer. The figure fits
  loss = a + b log10(M) by least squares (slope b per decade of slots, r^2).

Each point is a variant id (``rho_0p833``, ``slots_4096``) that the train rule builds like any other
(``stem.config.variant_spec``), trained at ``sweeps.scale`` / ``sweeps.stage`` with the stage's settings and
``sweeps.train`` over them, so results live in ``results/{experiment}/{scale}/{variant}/{stage}/``. Parameter
counts here are plain arithmetic on the config (torch-free: the workflow resolves the variants while it
builds the DAG); tests check them against the built models and against a hand computation. The report's figures
``sweep_rho`` / ``sweep_slots``: stem.report.sweep_figures.
"""
from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import asdict, dataclass, fields
from functools import lru_cache

from stem import layout as L
from stem.io import ConfigError, dataclass_mapping
from stem.io import deep_merge as _deep_merge
from stem.models.spec import VARIANT_KEYS, ModelConfig, resolve_placement, table_rows
from stem.specs import Variant, variant_node, variants

MODEL_DEFAULTS = {f.name: f.default for f in fields(ModelConfig)}

KINDS = ("rho", "slots")
TOLERANCE = {"p_tot": 0.001, "p_act": 0.03}   # relative deviations from the rho = 1 model's, default
CLAIMS = {
    "rho": ("DSE paper Sec. 3.1 / Fig. 2 left: validation loss vs rho is U-shaped; the pure MoE (rho = 1) is not "
            "optimal, the optimum is near rho = 0.75-0.80"),
    "slots": ("DSE paper Sec. 3.2 / Fig. 2 right: at a fixed backbone, validation loss decreases roughly "
              "log-linearly in the number of DSE slots M"),
}


class SweepError(ValueError):
    """A sweeps: section that cannot be built: one line naming the key, the value and what is expected."""


# ---- ids -------------------------------------------------------------------------------------------------
def rho_id(rho: float) -> str:
    """``rho_0p833`` for 0.833, ``rho_1`` for 1.0: at most three decimals, '.' written 'p' (file-safe)."""
    if not 0 <= rho <= 1 or round(rho, 3) != rho:
        raise SweepError(f"rho {rho!r}: expected a number in [0, 1] with at most three decimals")
    return "rho_" + f"{rho:.3f}".rstrip("0").rstrip(".").replace(".", "p")


def slots_id(rows_per_head: int) -> str:
    return f"slots_{int(rows_per_head)}"


# ---- parameter arithmetic (torch-free) --------------------------------------------------------------------
@dataclass(frozen=True)
class Counts:
    """Parameters of a model without its token embedding and LM head (the DSE paper's Sec. 3.1 convention)."""
    p_tot: int          # trainable parameters
    p_act: int          # used per token (shared + top-k experts, router, projections; no table rows)
    moe_free: int       # routed experts not selected per token
    dse_tables: int     # DSE table parameters (looked up, not in P_act)
    dse_slots: int      # DSE table rows, all tables of all DSE layers (M)
    moe_experts: int    # routed experts per MoE layer (0 without MoE layers)

    @property
    def p_free(self) -> int:
        return self.p_tot - self.p_act


def _moe(m: dict, key: str) -> int:
    """A routed-MoE field of a resolved model config, ModelConfig's default where absent."""
    return int(m.get(key, MODEL_DEFAULTS[key]))


def counts(m: dict) -> Counts:
    """Counts of a resolved model config (``ModelConfig.to_dict()``'s keys: shapes, ``ffn`` per layer, ``dse``
    with its ``layers``). Per layer: attention q, k, v, o (no biases) and two RMSNorms; FFN ``dense`` (SwiGLU,
    3 d d_ff) or ``moe`` (shared + E routed SwiGLU experts of width moe_d_ff or d_ff, router d x E; active: the
    shared and top-k experts and the router); a DSE layer's tables (first primes >= rows_per_head rows, d_mem /
    (orders x heads) wide), its key and value projections (d_mem x d each), depthwise convolution (d x kernel)
    and three RMSNorms; the final norm."""
    d, n_layers = int(m["d_model"]), int(m["n_layers"])
    kv = int(m["n_kv_heads"]) * (d // int(m["n_heads"]))
    ffn = tuple(m.get("ffn") or ()) or ("dense",) * n_layers
    tot = act = n_layers * (2 * d * d + 2 * d * kv + 2 * d) + d
    moe_free = n_moe = 0
    for kind in ffn:
        if kind == "dense":
            tot, act = tot + 3 * d * int(m["d_ff"]), act + 3 * d * int(m["d_ff"])
        elif kind == "moe":
            e = 3 * d * (_moe(m, "moe_d_ff") or int(m["d_ff"]))
            n_e, shared, k = _moe(m, "moe_experts"), _moe(m, "moe_shared"), _moe(m, "moe_top_k")
            tot += (shared + n_e) * e + d * n_e
            act += (shared + k) * e + d * n_e
            moe_free += (n_e - k) * e
            n_moe += 1
        else:
            raise SweepError(f"ffn kind {kind!r}: the sweep's parameter arithmetic knows dense and moe FFNs only")
    tables = slots = 0
    dse = m.get("dse")
    if dse:
        orders, heads = tuple(dse.get("orders", (2, 3))), int(dse.get("heads", 8))
        n_tables, d_mem = len(orders) * heads, int(dse["d_mem"])
        if d_mem % n_tables:   # as stem.models.dse.DSEMemory refuses it
            raise SweepError(f"dse.d_mem={d_mem}: must divide evenly over {n_tables} order x head tables")
        rows = sum(table_rows(int(dse["rows_per_head"]), n_tables))
        for _ in dse["layers"]:
            slots += rows
            tables += rows * (d_mem // n_tables)
            proj = 2 * d_mem * d + int(dse.get("conv_kernel", 4)) * d + 3 * d
            tot, act = tot + proj, act + proj
        tot += tables
    return Counts(tot, act, moe_free, tables, slots, _moe(m, "moe_experts") if n_moe else 0)


# ---- the sweeps' points ----------------------------------------------------------------------------------
# Their arithmetic reads the sweep spec (``cfg`` below): the mapping ``spec`` gives of a config's typed tree, the
# sweep_report job's --spec too (rules/sweep.smk).
def spec(exp) -> dict:
    """What a config's sweep points depend on, as the config writes it: its experiment, archs, variant_overrides
    and sweeps (``exp``: the typed tree, stem.config.experiment.Experiment, read by attribute as this module is below it;
    its nodes as mappings by ``dataclass_mapping``: the points' cache key is this mapping's JSON)."""
    return {"experiment": str(exp.experiment), "archs": dataclass_mapping(exp.archs),
            "variant_overrides": exp.variant_overrides, "sweeps": dataclass_mapping(exp.sweeps)}


def section(cfg: dict, kind: str) -> dict:
    sw = cfg.get("sweeps") or {}
    if kind not in KINDS:
        raise SweepError(f"sweep {kind!r}: expected one of {', '.join(KINDS)}")
    if kind not in sw:
        raise SweepError(f"{cfg.get('experiment', 'config')}: key 'sweeps.{kind}' missing (the {kind} sweep's "
                         "points; config/tiny.yaml has an example)")
    return sw[kind]


def _resolve(cfg: dict, spec: dict) -> dict:
    """A variant spec resolved at the sweep's scale into ModelConfig's dict form, without building it (the
    moe_* fields are read by ``counts``)."""
    arch = dict(cfg["archs"][cfg["sweeps"]["scale"]])
    n = int(arch["n_layers"])
    kind = spec.get("ffn", "dense")
    layers = resolve_placement(spec.get("placement"), n) if kind != "dense" else []
    out = {**arch, **{k: v for k, v in spec.items() if k not in (*VARIANT_KEYS, "stage")},
           "ffn": tuple(kind if i in layers else "dense" for i in range(n))}
    if spec.get("dse"):
        dse = dict(spec["dse"])
        out["dse"] = {**{k: v for k, v in dse.items() if k != "placement"},
                      "layers": resolve_placement(dse.get("placement"), n)}
    return out


def _named(cfg: dict, kind: str, key: str) -> dict:
    name = section(cfg, kind)[key]
    named = variants(cfg.get("variant_overrides") or {})
    if name not in named:
        raise SweepError(f"key 'sweeps.{kind}.{key}': {name!r} is not a variant; expected one of {sorted(named)}")
    return named[name].mapping()   # the arithmetic below reads the variant as a mapping (also the cache key)


def _memory(cfg: dict, kind: str) -> dict:
    """The DSE section the points use: the memory variant's (with variant_overrides), sweeps.{kind}.dse over it."""
    sw = section(cfg, kind)
    mem = _named(cfg, kind, "memory").get("dse")
    if not mem:
        raise SweepError(f"key 'sweeps.{kind}.memory': variant {sw['memory']!r} has no dse: section; expected a "
                         "variant with a DSE memory (e.g. dse)")
    mem = _deep_merge(mem, sw.get("dse") or {})
    n_tables = len(tuple(mem.get("orders", (2, 3)))) * int(mem.get("heads", 8))
    if int(mem["d_mem"]) % n_tables:
        raise SweepError(f"key 'sweeps.{kind}.dse': d_mem {mem['d_mem']} (memory {sw['memory']!r} with sweeps.{kind}.dse "
                         f"over it) must divide evenly over its {n_tables} order x head tables")
    return mem


def _base(cfg: dict, kind: str) -> dict:
    """The base variant (with variant_overrides), sweeps.{kind}.base_overrides over it."""
    base = _deep_merge(_named(cfg, kind, "base"), section(cfg, kind).get("base_overrides") or {})
    name = section(cfg, kind)["base"]
    if base.get("dse"):
        raise SweepError(f"key 'sweeps.{kind}.base': variant {name!r} already has a DSE memory; expected a backbone "
                         f"without one (the sweep adds sweeps.{kind}.memory's)")
    if kind == "rho" and base.get("ffn") != "moe":
        raise SweepError(f"key 'sweeps.rho.base': variant {name!r} has ffn {base.get('ffn', 'dense')!r}; expected a "
                         "variant with ffn moe (the rho = 1 pure MoE model)")
    return base


def train_settings(cfg: dict) -> dict:
    """The sweep points' training settings over their stage's (``sweeps.train``)."""
    return dict((cfg.get("sweeps") or {}).get("train") or {})


def _label(kind: str, x) -> str:
    return f"rho = {x:g}" if kind == "rho" else f"DSE rows/head {x}"


def _nearest_rows(budget: int, n_layers: int, n_tables: int, width: int) -> int:
    """rows_per_head whose tables (n_layers x the first n_tables primes >= it, ``width`` wide) hold the
    number of parameters nearest ``budget`` (the smaller on a tie)."""
    def params(r):
        return n_layers * width * sum(table_rows(r, n_tables))
    lo, hi = 2, max(4, 2 * budget // max(1, n_layers * width * n_tables) + 2)
    while params(hi) < budget:
        hi *= 2
    while hi - lo > 1:   # largest r with params(r) <= budget is lo (params is non-decreasing in r)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if params(mid) <= budget else (lo, mid)
    return lo if budget - params(lo) <= params(hi) - budget else hi


def rho_points(cfg: dict, strict: bool = True) -> list[dict]:
    """Every rho point: its variant spec and parameter counts next to the rho = 1 model's. ``strict`` (whenever
    the sweep is built or trained): a point outside sweeps.rho.tolerance, or with no parameters left for the
    memory, is an error; not strict (loading the config, which may have reshaped archs for another purpose):
    the point is still built and checked as a model config."""
    return [dict(p) for p in _rho_points(json.dumps(_relevant(cfg), sort_keys=True), strict)]


@lru_cache(maxsize=16)
def _rho_points(key: str, strict: bool) -> tuple:
    cfg = json.loads(key)
    sw = section(cfg, "rho")
    base, mem = _base(cfg, "rho"), _memory(cfg, "rho")
    tol = {**TOLERANCE, **(sw.get("tolerance") or {})}
    ref_m = _resolve(cfg, base)
    ref = counts(ref_m)
    n_e, k = _moe(ref_m, "moe_experts"), _moe(ref_m, "moe_top_k")
    if ref.moe_free <= 0:
        raise SweepError(f"key 'sweeps.rho.base': variant {sw['base']!r} has no inactive routed experts "
                         f"(moe_experts {n_e}, moe_top_k {k}); expected moe_experts > moe_top_k")
    points, seen = [], {}
    for rho in sw["values"]:
        try:
            vid = rho_id(rho)
        except SweepError as e:
            raise SweepError(f"key 'sweeps.rho.values': {e}") from None
        experts = k + math.floor(rho * (n_e - k) + 0.5)
        if experts in seen:
            raise SweepError(f"key 'sweeps.rho.values': rho {rho:g} and {seen[experts]:g} both give {experts} routed "
                             f"experts ({n_e - k} inactive at rho = 1, so rho moves in steps of 1/{n_e - k}); expected "
                             "values that give distinct expert counts")
        seen[experts] = rho
        spec = {**copy.deepcopy(base), "label": _label("rho", rho), "moe_experts": experts}
        if experts < n_e:
            moe_only = counts(_resolve(cfg, spec))
            probe = {**spec, "dse": {**mem, "rows_per_head": 2}}
            fixed = counts(_resolve(cfg, probe))
            proj = fixed.p_tot - fixed.dse_tables - moe_only.p_tot     # the memory's per-token parameters
            budget = ref.p_tot - moe_only.p_tot - proj
            if budget <= 0 and strict:
                raise SweepError(f"key 'sweeps.rho.values': rho {rho:g} frees {ref.p_tot - moe_only.p_tot:,} "
                                 f"parameters, fewer than the memory's {proj:,} per-token ones; expected a smaller rho")
            n_dse = len(_resolve(cfg, probe)["dse"]["layers"])
            n_tables = len(tuple(mem.get("orders", (2, 3)))) * int(mem.get("heads", 8))
            rows = _nearest_rows(max(budget, 1), n_dse, n_tables, int(mem["d_mem"]) // n_tables)
            spec["dse"] = {**mem, "rows_per_head": rows}
        elif rho != 1:
            raise SweepError(f"key 'sweeps.rho.values': rho {rho:g} keeps all {n_e} routed experts (steps of "
                             f"1/{n_e - k}), so nothing is left for the memory; expected rho <= "
                             f"{1 - 0.5 / (n_e - k):.3f} or 1")
        c = counts(_resolve(cfg, spec))
        dev_tot, dev_act = (c.p_tot - ref.p_tot) / ref.p_tot, (c.p_act - ref.p_act) / ref.p_act
        for key, dev in (("p_tot", dev_tot), ("p_act", dev_act)):
            if abs(dev) > tol[key] and strict:
                raise SweepError(f"key 'sweeps.rho.values': rho {rho:g} gives {key.replace('p_', 'P_')} "
                                 f"{getattr(c, key):,}, {100 * dev:+.2f}% from the rho = 1 model's "
                                 f"{getattr(ref, key):,}; expected within sweeps.rho.tolerance.{key} = {tol[key]:g}")
        points.append({"variant": vid, "rho": rho, "spec": spec, "moe_experts": experts,
                       "rows_per_head": spec["dse"]["rows_per_head"] if "dse" in spec else 0,
                       "rho_actual": c.moe_free / c.p_free if c.p_free else 0.0,
                       **asdict(c), "p_free": c.p_free, "p_tot_dev": dev_tot, "p_act_dev": dev_act,
                       "ref_p_tot": ref.p_tot, "ref_p_act": ref.p_act})
    return tuple(tuple(p.items()) for p in points)


def slots_points(cfg: dict) -> list[dict]:
    sw = section(cfg, "slots")
    base, mem = _base(cfg, "slots"), _memory(cfg, "slots")
    values = sw["rows_per_head"]
    if any(b <= a for a, b in zip(values, values[1:])):
        raise SweepError(f"key 'sweeps.slots.rows_per_head': {values}: expected strictly increasing values")
    points = []
    for rows in values:
        spec = {**copy.deepcopy(base), "label": _label("slots", rows), "dse": {**mem, "rows_per_head": int(rows)}}
        c = counts(_resolve(cfg, spec))
        points.append({"variant": slots_id(rows), "rows_per_head": int(rows), "spec": spec, **asdict(c),
                       "p_free": c.p_free})
    return points


def _relevant(cfg: dict) -> dict:
    """What the points depend on (the cache key): experiment, archs, overrides, sweeps (a sweep spec's keys)."""
    return {k: cfg.get(k) for k in ("experiment", "archs", "variant_overrides", "sweeps")}


def points(cfg: dict, kind: str, strict: bool = True) -> list[dict]:
    return rho_points(cfg, strict) if kind == "rho" else slots_points(cfg)


def variant_specs(cfg: dict, strict: bool = True) -> dict[str, Variant]:
    """{variant id: its Variant} of every sweep point of the config; a point's ``stage`` is the stage settings it
    overrides (``sweeps.train``)."""
    out = {}
    for kind in KINDS:
        if kind in (cfg.get("sweeps") or {}):
            for p in points(cfg, kind, strict):
                out[p["variant"]] = _point_variant(p["variant"], {**p["spec"], "stage": train_settings(cfg)})
    return out


@lru_cache(maxsize=256)
def _point_node(name: str, key: str) -> Variant:
    return variant_node(name, json.loads(key))


def _point_variant(name: str, spec: dict) -> Variant:
    """A point's node (parsed once per spec: the DAG asks for each point's spec per job)."""
    return _point_node(name, json.dumps(spec, sort_keys=True))


def variant_ids(cfg: dict, kind: str) -> list[str]:
    return [p["variant"] for p in points(cfg, kind)]


def validate(exp, origin: str):
    """The sweeps: section of a config's typed tree builds: its scale and stage are in the matrix, its variants
    are what the sweeps need, every point is a valid model config (one line naming the key otherwise). The
    tolerance of the rho points depends on the architecture and is checked when the sweep is built (``strict``), so
    a config that reshapes archs for another target still loads."""
    sw = exp.sweeps
    if not sw:
        return
    scale, stage = str(sw.scale), str(sw.stage)
    for what in ("archs", "tokenizer"):
        if scale not in getattr(exp, what):
            raise ConfigError(f"{origin}: key 'sweeps.scale': {scale!r} has no {what}.{scale}; expected a scale the "
                              f"experiment defines")
    settings = exp.stages.get(stage, {}).get(scale)
    if settings is None or settings.init_from is not None:
        raise ConfigError(f"{origin}: key 'sweeps.stage': {stage!r} at scale {scale!r} "
                          + ("is not in stages" if settings is None else f"starts from {settings.init_from_mapping!r}")
                          + "; expected a stage trained from scratch (init_from: null), e.g. pretrain")
    cfg = spec(exp)
    try:
        specs = variant_specs(cfg, strict=False)
        for name, point in specs.items():
            if name in variants(cfg.get("variant_overrides") or {}):
                raise SweepError(f"sweep point {name!r}: clashes with the variant of that name")
            try:
                ModelConfig.from_dict(_resolve(cfg, point.mapping()))
            except (TypeError, ValueError) as e:
                raise SweepError(f"sweep point {name!r}: {e}") from None
    except SweepError as e:
        raise ConfigError(f"{origin}: {e}") from None


# ---- the workflow (rules/sweep.smk) ---------------------------------------------------------------------------
def summaries(exp, kind: str) -> list[str]:
    """The training summaries a sweep of a config's typed tree collects (inputs of rule sweep_report)."""
    cfg = spec(exp)
    section(cfg, kind)
    sw = exp.sweeps
    return [L.summary(exp.experiment, sw.scale, v, sw.stage) for v in variant_ids(cfg, kind)]


def targets(exp) -> list[str]:
    """What `rule all` needs from the sweeps of a config's typed tree: every sweep's files when sweeps.in_all is
    true, else nothing."""
    sw = exp.sweeps
    return [f for kind in KINDS if sw and sw.in_all and getattr(sw, kind) is not None
            for f in L.sweep_files(exp.experiment, kind)]
