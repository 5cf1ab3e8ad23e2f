"""The accounting table: parameters and FLOPs of every variant at every scale of an experiment."""
from __future__ import annotations

from stem import config as C

COLUMNS = ["scale", "variant", "label", "total_params", "paper_total_params", "active_params",
           "gflops_per_token", "n_sparse_layers", "sparse_layers"]


def accounting_for(cfg: dict, scale: str, variant: str) -> dict:
    if scale not in cfg["archs"]:
        raise C.ConfigError(f"scale {scale!r}: expected one of {sorted(cfg['archs'])}")
    # torch: the report's table modules are imported by the DAG build (stem.plugins) and build tables without it
    from stem.models.accounting import accounting   # torch
    from stem.models.model import build_model       # torch
    return accounting(build_model(C.model_config_for(cfg, scale, variant), "meta"))


def accounting_rows(cfg: dict) -> list[dict]:
    rows = []
    for scale in cfg["archs"]:
        for variant, spec in C.variants(cfg).items():
            a = accounting_for(cfg, scale, variant)
            rows.append({"scale": scale, "variant": variant, "label": spec["label"], **a,
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
