"""Model configuration: one dataclass per model, built from an architecture and a variant.

An *architecture* (``350m`` = MobileLLM-350M, ``1b`` = Llama-3.2-1B, or a tiny stand-in) fixes the
shapes; a *variant* (``dense``, ``stem``, ``hashmoe``, ...) fixes which FFN kind each layer gets and
where optional DSE memories sit. Placement comes from config (``{every, offset}``, ``{start}``,
an explicit list, or relative ``positions``), never from code branches.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache

from stem.models.registry import check_ffn_kind, ffn_facts
from stem.options import TableInit, values

LOSS_CHUNK = 4096   # tokens a chunk of the loss under activation checkpointing (stem.models.model: _chunked_loss)

TABLE_INITS = values(TableInit)


def _is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin (exact below 3.3e24)."""
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)
    if n < 2 or any(n % p == 0 for p in small):
        return n in small
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@lru_cache(maxsize=4096)
def table_rows(rows_per_head: int, tables: int) -> tuple[int, ...]:
    """The rows of a DSE layer's ``tables`` tables: the first ``tables`` primes >= ``rows_per_head`` (distinct
    primes, one per order x head; stem.models.dse builds them, stem.sweeps counts them)."""
    out, n = [], rows_per_head
    while len(out) < tables:
        if _is_prime(n):
            out.append(n)
        n += 1
    return tuple(out)
OPTIONAL = {"omit_default": True}   # field metadata: left out of to_dict() at its default (see ModelConfig.to_dict)


@dataclass(frozen=True)
class RopeScaling:
    """RoPE adjustment for context extension (OLMo-core style: a small config object).

    kind: ``none``; ``theta`` (replace the base by ``theta``); ``linear`` (position interpolation by
    ``factor``); ``yarn`` (Peng et al. 2023: NTK-by-parts interpolation by ``factor`` over
    ``original_max_seq_len`` with the paper's alpha = ``beta_slow`` and beta = ``beta_fast`` rotation
    bounds, and its attention temperature). ``ramp``: ``rotations`` (the paper: gamma linear in the
    rotation count r) or ``dims`` (the reference code and transformers: linear in the dimension index);
    ``llama3`` (Llama 3.1/3.2's published scaling: wavelengths above ``original_max_seq_len / low_freq_factor``
    divided by ``factor``, below ``original_max_seq_len / high_freq_factor`` kept, smoothly blended between).
    ``low_freq_factor`` / ``high_freq_factor`` are left out of a spec JSON at their defaults (``OPTIONAL``).
    """

    kind: str = "none"
    theta: float | None = None
    factor: float = 1.0
    original_max_seq_len: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    ramp: str = "rotations"
    low_freq_factor: float = field(default=1.0, metadata=OPTIONAL)    # llama3
    high_freq_factor: float = field(default=4.0, metadata=OPTIONAL)   # llama3

    def __post_init__(self):
        if self.kind not in ("none", "theta", "linear", "yarn", "llama3"):
            raise ValueError(f"rope_scaling.kind={self.kind!r}: expected one of none, theta, linear, yarn, llama3")
        if self.kind == "theta" and not self.theta:
            raise ValueError("rope_scaling.kind='theta' needs rope_scaling.theta (the new base)")
        if self.kind in ("linear", "yarn", "llama3") and self.factor < 1:
            raise ValueError(f"rope_scaling.factor={self.factor}: expected >= 1")
        if self.kind in ("yarn", "llama3") and not self.original_max_seq_len:
            raise ValueError(f"rope_scaling.kind={self.kind!r} needs rope_scaling.original_max_seq_len")
        if self.kind == "llama3" and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(f"rope_scaling.low_freq_factor={self.low_freq_factor}, high_freq_factor="
                             f"{self.high_freq_factor}: expected 0 < low_freq_factor < high_freq_factor (e.g. 1 and 4)")
        if self.kind == "yarn" and not 0 < self.beta_slow < self.beta_fast:
            raise ValueError(f"rope_scaling.beta_slow={self.beta_slow}, beta_fast={self.beta_fast}: "
                             "expected 0 < beta_slow < beta_fast (the paper's alpha < beta, e.g. 1 and 32)")
        if self.ramp not in ("rotations", "dims"):
            raise ValueError(f"rope_scaling.ramp={self.ramp!r}: expected rotations (the YaRN paper) or dims")


@dataclass(frozen=True)
class DSEConfig:
    """Deep Sparse Embedding (hashed N-gram memory with context-aware gating), see research notes C."""

    layers: tuple[int, ...] = ()
    orders: tuple[int, ...] = (2, 3)
    heads: int = 8
    rows_per_head: int = 4096   # each head's table has the first prime >= this many rows
    d_mem: int = 256            # concatenated memory width (split evenly over orders x heads)
    conv_kernel: int = 4
    seed: int = 0

    def __post_init__(self):
        orders = self.orders
        if (not isinstance(orders, (tuple, list)) or not orders
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in orders)
                or len(set(orders)) != len(orders)):
            shown = list(orders) if isinstance(orders, (tuple, list)) else repr(orders)
            raise ValueError(f"dse.orders={shown}: expected a non-empty list of distinct whole N-gram orders >= 2 "
                             "(the DSE paper's Eq. 2 concatenates n = 2..N; order 1 is the token alone, which the "
                             "token embedding already holds)")
        for key in ("heads", "rows_per_head", "d_mem", "conv_kernel"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"dse.{key}={value!r}: expected a whole number >= 1")
        if self.d_mem % (len(orders) * self.heads):
            raise ValueError(f"dse.d_mem={self.d_mem}: must divide evenly over {len(orders) * self.heads} order x head "
                             f"tables ({len(orders)} orders x {self.heads} heads)")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    max_seq_len: int
    ffn: tuple[str, ...] = ()           # FFN kind per layer; empty = all dense
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    norm_eps: float = 1e-5
    n_experts: int = 16                 # Hash-MoE experts per sparse layer
    hash_seed: int = 0                  # seed of the balanced token -> expert map
    table_init: str = "xavier_normal"   # STEM tables: official code uses xavier-normal on [V, d_ff]
    table_init_std: float = 0.02        # used when table_init == "normal"
    init_std: float = 0.02
    dse: DSEConfig | None = None
    # Routed top-k MoE (ffn kind ``moe``, DeepSeekMoE; stem.models.moe): per MoE layer ``moe_shared`` shared
    # and ``moe_experts`` routed SwiGLU experts of hidden width ``moe_d_ff`` (0: d_ff), ``moe_top_k`` routed
    # experts per token, load-balancing loss weight ``moe_aux_coef`` (alpha).
    moe_experts: int = field(default=8, metadata=OPTIONAL)
    moe_shared: int = field(default=1, metadata=OPTIONAL)
    moe_top_k: int = field(default=2, metadata=OPTIONAL)
    moe_d_ff: int = field(default=0, metadata=OPTIONAL)
    moe_aux_coef: float = field(default=0.01, metadata=OPTIONAL)
    # The LM head is the token embedding (one V x d parameter), as SmolLM2, Llama-3.2-1B and the official STEM
    # configs have it; the paper's models are untied (Sec. 4.1). Counted once (stem.models.accounting).
    tie_embeddings: bool = field(default=False, metadata=OPTIONAL)

    def __post_init__(self):
        ffn = tuple(self.ffn) or ("dense",) * self.n_layers
        object.__setattr__(self, "ffn", ffn)
        if len(ffn) != self.n_layers:
            raise ValueError(f"ffn: {len(ffn)} kinds given for n_layers={self.n_layers}")
        for kind in ffn:
            check_ffn_kind(kind)
        if self.d_model % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(f"d_model={self.d_model}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}: "
                             "need d_model % n_heads == 0 and n_heads % n_kv_heads == 0")
        if self.table_init not in TABLE_INITS:
            raise ValueError(f"table_init={self.table_init!r}: expected one of {', '.join(TABLE_INITS)}")
        if self.dse is not None:
            bad = [i for i in self.dse.layers if not 0 <= i < self.n_layers]
            if bad:
                raise ValueError(f"dse.layers {bad}: outside 0..{self.n_layers - 1}")
        if self.moe_experts < 1:
            raise ValueError(f"moe_experts={self.moe_experts}: expected >= 1 (routed experts per MoE layer)")
        if not 1 <= self.moe_top_k <= self.moe_experts:
            raise ValueError(f"moe_top_k={self.moe_top_k}: expected 1 <= moe_top_k <= moe_experts ({self.moe_experts})")
        if self.moe_shared < 0:
            raise ValueError(f"moe_shared={self.moe_shared}: expected >= 0 (shared experts per MoE layer)")
        if self.moe_d_ff < 0:
            raise ValueError(f"moe_d_ff={self.moe_d_ff}: expected >= 0 (0: each expert is d_ff={self.d_ff} wide)")
        if not self.moe_aux_coef >= 0:
            raise ValueError(f"moe_aux_coef={self.moe_aux_coef}: expected >= 0 (the balance loss weight alpha)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def expert_d_ff(self) -> int:
        """Hidden width of each routed-MoE expert (shared and routed)."""
        return self.moe_d_ff or self.d_ff

    def to_dict(self) -> dict:
        """The fields as a mapping; those added after the first specs were written (``OPTIONAL``: the MoE
        keys) only when they differ from their default, so the spec JSON of a model that does not use them,
        and the jobs Snakemake reruns, stay as they were. ``from_dict`` fills them back in."""
        d = dataclasses.asdict(self)
        for obj, out in ((self, d), (self.rope_scaling, d["rope_scaling"])):
            for f in dataclasses.fields(obj):
                if f.metadata.get("omit_default") and out[f.name] == f.default:
                    del out[f.name]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"model config: unknown keys {sorted(unknown)}")
        d["ffn"] = tuple(d.get("ffn", ()))
        d["rope_scaling"] = RopeScaling(**(d.get("rope_scaling") or {}))
        if d.get("dse"):
            dse = dict(d["dse"])
            dse["layers"] = tuple(dse.get("layers", ()))
            dse["orders"] = tuple(dse.get("orders", (2, 3)))
            d["dse"] = DSEConfig(**dse)
        return cls(**d)


def param_count(cfg: ModelConfig) -> int | None:
    """The parameters of the model as built (``stem.models.accounting``'s ``total_params``, which stays the
    truth; tests/test_models.py checks the two agree), in closed form, without torch: the token embedding and the
    untied LM head (V d each; once when tied); per layer attention (q and o d x d, k and v d x kv) and two RMSNorms (d each); each
    layer's FFN (its kind's declared ``params``, stem.models.registry.FFNFacts); each DSE memory (its tables,
    the first primes >= rows_per_head rows, d_mem / (orders x heads) wide; key and value d_mem x d; the depthwise
    convolution d x kernel; three RMSNorms); the final norm. None when an FFN kind declares no ``params``."""
    d, v = cfg.d_model, cfg.vocab_size
    ffn = [ffn_facts(kind).params for kind in cfg.ffn]
    if any(f is None for f in ffn):
        return None
    kv = cfg.n_kv_heads * cfg.head_dim
    total = (1 if cfg.tie_embeddings else 2) * v * d + cfg.n_layers * (2 * d * d + 2 * d * kv + 2 * d) + d + sum(f(cfg) for f in ffn)
    if cfg.dse is not None:
        dc = cfg.dse
        n_tables = len(dc.orders) * dc.heads
        per_layer = (sum(table_rows(dc.rows_per_head, n_tables)) * (dc.d_mem // n_tables)
                     + 2 * dc.d_mem * d + dc.conv_kernel * d + 3 * d)
        total += len(dc.layers) * per_layer
    return total


def resolve_placement(spec, n_layers: int) -> list[int]:
    """Layer indices from a placement spec.

    ``{"every": k, "offset": o}`` -> o, o+k, ... (STEM-1/3: every 3 offset 2 -> 2, 5, 8, ...);
    ``{"start": s}`` -> s..n-1 (STEM-full: start 1); a list -> itself;
    ``{"positions": [f, ...]}`` -> round(f * n) clamped to [1, n-1] (DSE at relative depths).
    """
    if spec is None:
        return []
    if isinstance(spec, (list, tuple)):
        layers = [int(i) for i in spec]
    elif isinstance(spec, dict) and "every" in spec:
        layers = list(range(int(spec.get("offset", 0)), n_layers, int(spec["every"])))
    elif isinstance(spec, dict) and "start" in spec:
        layers = list(range(int(spec["start"]), n_layers))
    elif isinstance(spec, dict) and "positions" in spec:
        layers = sorted({min(max(round(f * n_layers), 1), n_layers - 1) for f in spec["positions"]})
    else:
        raise ValueError(f"placement {spec!r}: expected a list, {{every, offset}}, {{start}} or {{positions}}")
    bad = [i for i in layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"placement {spec!r}: layers {bad} outside 0..{n_layers - 1}")
    return layers


# A variant's keys that are not ModelConfig fields: its FFN kind and placement, DSE memory, optimizer and insertion
# settings, its presentation (the report's label, figure label, colour and figures; stem.config.variant_labels) and
# its role as the report's baseline (stem.config.baseline_variant).
VARIANT_KEYS = ("ffn", "placement", "label", "figure_label", "color", "baseline", "figures", "dse", "optim", "insert")


def model_config(arch: dict, variant: dict) -> ModelConfig:
    """Combine an architecture dict (shapes) and a variant dict (ffn kind, placement, options)."""
    arch = dict(arch)
    n = int(arch["n_layers"])
    kind = variant.get("ffn", "dense")
    layers = resolve_placement(variant.get("placement"), n) if kind != "dense" else []
    ffn = tuple(kind if i in layers else "dense" for i in range(n))
    extra = {k: v for k, v in variant.items() if k not in VARIANT_KEYS}
    dse = None
    if variant.get("dse"):
        spec = dict(variant["dse"])
        dse = dict(spec, layers=resolve_placement(spec.pop("placement", None), n))
        dse.pop("placement", None)
    return ModelConfig.from_dict({**arch, **extra, "ffn": ffn, "dse": dse})
