"""The accounting table: parameters and FLOPs of every variant at every scale of an experiment."""
from __future__ import annotations

from dataclasses import dataclass, field

from stem import config as C
from stem import seeds
from stem.config.experiment import Arch, Experiment, dataclass_mapping, node
from stem.models.spec import model_config
from stem.options import Experiment as ExperimentName
from stem.options import Scale

COLUMNS = ["scale", "variant", "label", "total_params", "paper_total_params", "active_params",
           "gflops_per_token", "n_sparse_layers", "sparse_layers"]


@dataclass(frozen=True)
class Accounted:
    """What the accounting reads of an experiment config, typed as the config's own nodes: the ``params`` job's
    part of it (rules/report.smk passes experiment, archs and variant_overrides)."""
    experiment: ExperimentName
    archs: dict[Scale, Arch]
    variant_overrides: dict[str, dict] = field(default_factory=dict)
    variants = Experiment.variants   # config/variants.yaml with the overrides, as the whole config's
    variant = Experiment.variant


def accounted(spec: dict, origin: str) -> Accounted:
    """The ``params`` job's spec typed (one ``ConfigError`` line ``{origin}: key '...': ...`` otherwise)."""
    try:
        return node(Accounted, spec)
    except C.ConfigError as e:
        raise C.ConfigError(f"{origin}: {e}") from None


def model_of(exp: Experiment | Accounted, scale: str, variant: str) -> tuple[dict, dict]:
    """A configured model as mappings: its architecture (``archs.<scale>``) and its variant's spec
    (config/variants.yaml with the config's variant_overrides; a seed of a matrix cell, stem.seeds, is its
    variant's model)."""
    if scale not in exp.archs:
        raise C.ConfigError(f"scale {scale!r}: expected one of {sorted(map(str, exp.archs))}")
    spec = exp.variant(seeds.JobId.parse(scale, variant, "").variant)
    if spec is None:
        raise C.ConfigError(f"variant {variant!r}: expected one of {sorted(exp.variants())}")
    return dataclass_mapping(exp.archs[scale]), spec.model_spec()


def model_accounting(arch: dict, spec: dict) -> dict:
    """Parameters and FLOPs of the model ``arch`` and ``spec`` (``model_of``) build, counted on the meta device."""
    # torch: the report's table modules are imported by the DAG build (stem.plugins) and build tables without it
    from stem.models.accounting import accounting   # torch
    from stem.models.model import build_model       # torch
    return accounting(build_model(model_config(arch, spec), "meta"))


def accounting_for(exp: Experiment | Accounted, scale: str, variant: str) -> dict:
    return model_accounting(*model_of(exp, scale, variant))


def accounting_rows(exp: Experiment | Accounted) -> list[dict]:
    rows = []
    for scale in map(str, exp.archs):
        for variant, spec in exp.variants().items():
            a = accounting_for(exp, scale, variant)
            rows.append({"scale": scale, "variant": variant, "label": spec.label, **a,
                         "n_sparse_layers": len(a["sparse_layers"] or a["dse_layers"]),
                         "sparse_layers": " ".join(map(str, a["sparse_layers"] or a["dse_layers"]))})
    return rows


def _fmt(n: float) -> str:
    return f"{n / 1e9:.3f}B" if n >= 1e8 else f"{n / 1e6:.3f}M"


def to_markdown(rows: list[dict], title: str) -> str:
    head = ("| Scale | Variant | Label | #Total | #Total (paper conv.) | #Active | GFLOPs/token | Sparse layers | "
            "P_tot | P_act | DSE params |")
    lines = [f"# {title}", "", head, "|" + "---|" * 11]
    for r in rows:
        lines.append(f"| {r['scale']} | {r['variant']} | {r['label']} | {_fmt(r['total_params'])} | "
                     f"{_fmt(r['paper_total_params'])} | {_fmt(r['active_params'])} | {r['gflops_per_token']:.4f} | "
                     f"{r['n_sparse_layers']}: {r['sparse_layers'] or '-'} | {_fmt(r['p_tot'])} | {_fmt(r['p_act'])} | "
                     f"{_fmt(r['dse_params']) if r['dse_params'] else '-'} |")
    lines += ["", "#Total: exact count of the model as built. #Total (paper conv.): dense total + "
              "n_STEM_layers x V x d_ff (Table 3's convention; exact count for Hash-MoE, MoE and DSE). #Active: parameters "
              "in matrix products per token (table lookups and unselected experts excluded). GFLOPs/token = "
              "2 x #Active / 1e9. P_tot, P_act: the DSE paper's convention (its Sec. 3.1), without the vocabulary "
              "embedding and LM head; DSE params: the hashed DSE tables."]
    return "\n".join(lines) + "\n"
