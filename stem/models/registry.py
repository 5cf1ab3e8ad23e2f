"""FFN kinds and parameter roles: the one place that says what a kind is and how its parameters are treated.

An FFN kind is a module class registered by name in ``stem.registry.FFN_KINDS`` (the built-in ones below as
"module:Class" with ``declare_ffn``, another with ``@register_ffn("name", ...)``, ``declare_ffn`` or
``FFN_KINDS.add``) and built as ``cls(cfg, layer)``. Its registration may carry torch-free facts
(``FFNFacts``, registered in ``stem.registry.FFN_FACTS``: a token-indexed table, lookup parameters, its parameter
count in closed form, its activations saved for backward) that let the workflow build its DAG and the memory
estimate count a layer without torch or naming a kind; every model build checks them against the module.
A module (an FFN, a table inside one, a DSE memory) declares what is special about its own parameters:

- ``param_roles``: {parameter name relative to the module (``fnmatch`` pattern): Role}. A parameter
  without a role is a backbone parameter: group ``norm`` if 1-D else ``matrix``, counted active,
  initialised by the backbone's normal init.
- ``shard_unit = True``: the module is its own FSDP unit sharded over all ranks (tables, experts).
- ``aux_loss``: a module whose training forward sets ``self.aux_loss`` (a scalar tensor; the routed MoE's
  load-balancing loss) adds it to the training objective: ``Transformer.forward`` with targets returns the
  cross-entropy plus these in training mode (the cross-entropy alone in eval mode) and takes them (resets
  them to None) on every forward.

Accounting (``stem.models.accounting``), optimizer groups (``Transformer.param_groups``), initialisation
(``Transformer.init_weights``) and sharding (``stem.train.plan.ParallelPlan.shard_units``) read these
declarations; none of them names a kind. A layer is *sparse* when its FFN declares a role for any parameter.
This module imports nothing from the model so the config can validate kinds without importing torch.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable

from stem.registry import FFN_FACTS, FFN_KINDS, OPTIM_GROUPS  # noqa: F401 (re-exported: the registries)

COUNTS = ("active", "lookup", "expert")
INITS = ("normal", "module")


@dataclass(frozen=True)
class Role:
    """How one parameter is treated.

    group: optimizer group (a key of ``OPTIM_GROUPS``).
    count: accounting, ``active`` (a matrix used per token), ``lookup`` (a table read by index: zero FLOPs,
        not active) or ``expert`` (dim 0 indexes experts, ``active_experts`` of which run per token).
    active_experts: for ``count="expert"``, how many of the E experts run per token (Hash-MoE 1, a routed
        top-k MoE k; a module whose k comes from its config declares its roles per instance).
    paper_table: the paper's Table 3 convention adds it to the dense model's total (STEM tables).
    init: ``normal`` (the backbone's normal init) or ``module`` (the declaring module's
        ``reset_parameters()``, called after the backbone's init, in module order).
    """
    group: str = "matrix"
    count: str = "active"
    paper_table: bool = False
    init: str = "normal"
    active_experts: int = 1

    def __post_init__(self):
        if self.count not in COUNTS:
            raise ValueError(f"Role.count={self.count!r}: expected one of {', '.join(COUNTS)}")
        if self.init not in INITS:
            raise ValueError(f"Role.init={self.init!r}: expected one of {', '.join(INITS)}")
        if self.active_experts < 1:
            raise ValueError(f"Role.active_experts={self.active_experts}: expected >= 1")



@dataclass(frozen=True)
class FFNFacts:
    """What the workflow knows of an FFN kind without importing its module (torch-free), declared with its
    registration (``declare_ffn`` / ``register_ffn``). ``None``: not declared; the workflow then builds the
    model on the meta device to find out (torch in the DAG). Every model build compares each declared fact
    with the built module (``check_facts``): a wrong declaration is a one-line error.

    table: a token-indexed table (a ``lookup`` role counted ``paper_table``: STEM's U); with ``lookup`` it
        picks a checkpoint's default analyses (stem.analysis.workflow.model_kind).
    lookup: any ``lookup``-role parameter (a DSE memory is not an FFN: ``ModelConfig.dse`` says it).
    params: ``params(cfg) -> int``, the parameters of one layer's FFN in closed form (exact); the workflow's
        state bytes (stem.models.spec.param_count).
    activations: ``activations(cfg) -> int``, the bytes per token one layer's FFN saves for backward under bf16
        autocast (stem.train.memory.estimate, the closed form; None: counted as a SwiGLU FFN's, ``swiglu_activations``).
    hf: the module a layer of this kind becomes in an exported transformers model (``python -m stem export-hf``;
        the remote code stem/hf/remote/modeling_stem.py builds it from these data, naming no kind):
        ``{"module": "swiglu", "gate": [...], "up": [...]}``, y = W_d(SiLU(sum of gate) * sum of up), each a list
        of ``"proj"`` (W_gate x / W_up x) and ``"table"`` (the layer's V x d_ff table read by token id);
        ``{"module": "hash_experts"}`` (Hash-MoE's E SwiGLU experts picked by a saved token -> expert map);
        ``{"module": "routed_experts"}`` (a shared SwiGLU + softmax-routed top-k experts). None: not exportable.
    """
    table: bool | None = None
    lookup: bool | None = None
    params: Callable | None = None
    activations: Callable | None = None
    hf: dict | None = None


def declare_ffn(name: str, entry, *, table: bool | None = None, lookup: bool | None = None,
                params: Callable | None = None, activations: Callable | None = None, hf: dict | None = None):
    """Register FFN kind ``name`` (a class or its ``"module:Class"``) with its torch-free facts (FFNFacts)."""
    FFN_KINDS.add(name, entry)
    FFN_FACTS.add(name, FFNFacts(table, lookup, params, activations, hf))
    return entry


def _swiglu(d: int, f: int) -> int:
    return 3 * d * f


def swiglu_activations(c) -> int:
    """Bytes per token a SwiGLU-shaped FFN saves for backward (dense, STEM): gate, SiLU, up or table row, product,
    2 d_ff each (bf16)."""
    return 8 * c.d_ff


def _routed_moe_activations(c) -> int:
    """The routed MoE's (stem.models.moe): 8 f_e per shared expert and per routed assignment (k a token), the
    router's fp32 input 4 d and scores 4 E, each assignment's gathered input and expert output 2 d + 2 d, and 26 per
    assignment (its expert index from top-k, the gather and inverse-permutation indices, int64, its gate in bf16)."""
    k = c.moe_top_k
    return 8 * c.expert_d_ff * (c.moe_shared + k) + 4 * c.d_model + 4 * k * c.d_model + 4 * c.moe_experts + 26 * k


# Optimizer groups in the order the optimizer lists them: name -> (LR multiplier, weight decay or None for
# the config's). Norms are not decayed; STEM tables are decayed like the backbone (the official code's
# separate AdamW uses the same hyper-parameters); DSE tables follow the DSE paper (no decay, LR x5).
OPTIM_GROUPS.add("matrix", (1.0, None))
OPTIM_GROUPS.add("norm", (1.0, 0.0))
OPTIM_GROUPS.add("table", (1.0, None))
OPTIM_GROUPS.add("dse_table", (5.0, 0.0))


# The built-in kinds as "module:Class" (imported on first use, so a config is checked without importing torch,
# e.g. while Snakemake builds the DAG) with their facts; another kind registers the same way from a plugin
# module (stem.plugins): ``declare_ffn("name", "module:Class", ...)`` or ``@register_ffn("name", ...)``.
def _swiglu_hf(gate: str, up: str) -> dict:
    """FFNFacts.hf of a SwiGLU-shaped kind: each operand a ``+``-joined sum of ``proj`` and ``table``."""
    return {"module": "swiglu", "gate": gate.split("+"), "up": up.split("+")}


_STEM = {"table": True, "lookup": True, "activations": swiglu_activations}
declare_ffn("dense", "stem.models.ffn:DenseFFN", table=False, lookup=False,        # gate, up, down
            params=lambda c: _swiglu(c.d_model, c.d_ff), activations=swiglu_activations, hf=_swiglu_hf("proj", "proj"))
declare_ffn("stem", "stem.models.ffn:StemFFN", **_STEM,                            # gate, V x d_ff table, down
            params=lambda c: 2 * c.d_model * c.d_ff + c.vocab_size * c.d_ff, hf=_swiglu_hf("proj", "table"))
declare_ffn("stem_gate", "stem.models.ffn:StemGateFFN", **_STEM,                   # table, up, down
            params=lambda c: 2 * c.d_model * c.d_ff + c.vocab_size * c.d_ff, hf=_swiglu_hf("table", "proj"))
declare_ffn("stem_dagger", "stem.models.ffn:StemDaggerFFN", **_STEM,               # gate, up, down, table
            params=lambda c: _swiglu(c.d_model, c.d_ff) + c.vocab_size * c.d_ff, hf=_swiglu_hf("proj", "proj+table"))
declare_ffn("hashmoe", "stem.models.ffn:HashMoEFFN", table=False, lookup=False,    # E SwiGLU experts
            params=lambda c: c.n_experts * _swiglu(c.d_model, c.d_ff),
            activations=lambda c: swiglu_activations(c) + 2 * c.d_model,           # + the gathered inputs
            hf={"module": "hash_experts"})
declare_ffn("moe", "stem.models.moe:RoutedMoEFFN", table=False, lookup=False,      # router, shared + routed
            params=lambda c: c.d_model * c.moe_experts
            + (c.moe_shared + c.moe_experts) * _swiglu(c.d_model, c.expert_d_ff), activations=_routed_moe_activations,
            hf={"module": "routed_experts"})


def register_ffn(name: str, **facts):
    """Class decorator: register an FFN kind under ``name`` (built as ``cls(cfg, layer)``), with its facts
    (FFNFacts' keywords; none given: the workflow builds the model to find them out)."""
    def deco(cls):
        declare_ffn(name, cls, **facts)
        return cls
    return deco


def ffn_facts(name: str) -> FFNFacts:
    """The declared facts of FFN kind ``name`` (all ``None`` for a kind registered without them)."""
    check_ffn_kind(name)
    return FFN_FACTS.get(name, FFNFacts())


def module_facts(ffn) -> dict:
    """The facts of a built FFN module (what ``FFNFacts`` declares), read from its parameters and roles."""
    roles = param_roles(ffn).values()
    return {"table": any(r.count == "lookup" and r.paper_table for r in roles),
            "lookup": any(r.count == "lookup" for r in roles),
            "params": sum(p.numel() for p in ffn.parameters())}


def check_facts(name: str, ffn, cfg, layer: int):
    """A one-line ValueError when FFN kind ``name``'s declared facts disagree with its module as built."""
    declared, built = ffn_facts(name), module_facts(ffn)
    want = {"table": declared.table, "lookup": declared.lookup,
            "params": None if declared.params is None else declared.params(cfg)}
    bad = [f"{k}={want[k]!r} (the module: {built[k]!r})" for k in want if want[k] is not None and want[k] != built[k]]
    if bad:
        raise ValueError(f"ffn kind {name!r} ({type(ffn).__name__}, layer {layer}): its registration declares "
                         f"{', '.join(bad)}; fix the facts given to declare_ffn/register_ffn")


def register_group(name: str, lr_mult: float = 1.0, weight_decay: float | None = None):
    """Add an optimizer group (listed after the existing ones)."""
    OPTIM_GROUPS.add(name, (lr_mult, weight_decay))


def check_ffn_kind(name: str):
    if name not in FFN_KINDS:
        raise ValueError(f"ffn kind {name!r}: expected one of {', '.join(FFN_KINDS)}")


def ffn_class(name: str) -> type:
    check_ffn_kind(name)
    return FFN_KINDS[name]


def param_roles(model) -> dict[int, Role]:
    """{id(parameter): Role} for every parameter some module of ``model`` declares a role for."""
    roles: dict[int, Role] = {}
    for m in model.modules():
        declared = getattr(m, "param_roles", None)
        if not declared:
            continue
        named = list(m.named_parameters())
        for pattern, role in declared.items():
            matched = [p for name, p in named if fnmatch.fnmatchcase(name, pattern)]
            if not matched:
                raise ValueError(f"{type(m).__name__}.param_roles[{pattern!r}]: matches none of its parameters "
                                 f"({', '.join(n for n, _ in named) or 'none'})")
            if role.group not in OPTIM_GROUPS:
                raise ValueError(f"{type(m).__name__}.param_roles[{pattern!r}]: group {role.group!r} is not "
                                 f"registered (expected one of {', '.join(OPTIM_GROUPS)})")
            for p in matched:
                roles.setdefault(id(p), role)   # the first matching pattern wins
    return roles
