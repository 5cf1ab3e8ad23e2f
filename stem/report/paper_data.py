"""The STEM paper's published numbers, transcribed into reference/paper/*.csv.

Every CSV is long format with columns ``table,scale,variant,row,column,value,unit,source``:
``scale`` is ``350m``/``1b`` (empty where not applicable), ``variant`` a stable id (config/variants.yaml's),
``row`` the paper's row label (that file's ``label:``), ``column`` a stable metric id and ``source`` the
provenance (printed row/column header, or a verbatim quote of the paper text).

Another paper's tables live in their own folder under ``reference/`` and are named ``folder/table``
(``dse_paper/table1``: the DSE paper, Cheng et al., "Conditional Memory via Scalable Lookup"); ``available_tables``
lists the STEM paper's only.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import pandas as pd

REFERENCE_DIR = Path(__file__).resolve().parents[2] / "reference"
PAPER_DIR = REFERENCE_DIR / "paper"
OTHER_PAPERS = ("dse_paper",)   # folders under reference/ holding another paper's tables
COLUMNS = ["table", "scale", "variant", "row", "column", "value", "unit", "source"]

COMMONSENSE_TASKS = ["arc_easy", "arc_challenge", "boolq", "piqa", "social_iqa", "hellaswag",
                     "openbookqa", "winogrande"]
TASKS = {
    "table3": COMMONSENSE_TASKS,
    "table4": COMMONSENSE_TASKS + ["gsm8k", "mmlu"],
    "table5": ["bbh", "musr", "lb_multi_lt4k", "lb_multi_4_8k", "lb_multi_ge8k",
               "lb_code_lt4k", "lb_code_4_8k", "lb_code_ge8k"],
    "table6": ["lb_0_2k", "lb_2_4k", "lb_4_6k", "lb_6_8k", "lb_8_10k", "lb_10_12k", "lb_12k_plus"],
}


def available_tables() -> list[str]:
    return sorted(p.stem for p in PAPER_DIR.glob("*.csv"))


def other_tables() -> list[str]:
    """The other papers' tables, as ``folder/table``."""
    return sorted(f"{d}/{p.stem}" for d in OTHER_PAPERS for p in (REFERENCE_DIR / d).glob("*.csv"))


@lru_cache(maxsize=None)
def _read(name: str) -> pd.DataFrame:
    if name not in available_tables() and name not in other_tables():
        raise ValueError(f"unknown paper table {name!r}; available: {', '.join(available_tables() + other_tables())}")
    path = REFERENCE_DIR / f"{name}.csv" if "/" in name else PAPER_DIR / f"{name}.csv"
    df = pd.read_csv(path, dtype=str, keep_default_na=False)
    numeric = pd.to_numeric(df["value"], errors="coerce")
    if numeric.notna().all():
        df["value"] = numeric.astype(float)
    else:  # table2 has text cells (LR schedule, cross-doc masking): keep those as str
        df["value"] = [s if pd.isna(n) else float(n) for s, n in zip(df["value"], numeric)]
    return df


def load_table(name: str) -> pd.DataFrame:
    """One paper table as a long DataFrame (a copy; safe to modify)."""
    return _read(name).copy()
