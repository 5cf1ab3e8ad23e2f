"""The variant table of docs/variants.md, generated from config/variants.yaml (the one place a variant is
defined; tests/test_variants.py fails when the two differ). After editing variants.yaml:

    python scripts/variants_table.py      # rewrites the table between the markers of docs/variants.md
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from stem import layout as L  # noqa: E402
from stem.io import atomic_write_text, variants_file  # noqa: E402

DOC = L.REPO / "docs" / "variants.md"
BEGIN = "<!-- generated from config/variants.yaml by scripts/variants_table.py: edit that file, then run this -->"
END = "<!-- end of the generated variant table -->"
COLUMNS = ("label", "ffn", "placement")      # their own columns; the figures' keys are left out
PRESENTATION = ("color", "figure_label", "figures")
ORDINAL = {1: "", 2: "second ", 3: "third "}


def layers(placement) -> str:
    """A variant's ``placement`` in words (stem.models.spec.layers_for reads it)."""
    if placement is None:
        return "-"
    if isinstance(placement, list):
        return ", ".join(map(str, placement))
    if "every" in placement:
        k = placement["every"]
        return f"every {ORDINAL.get(k, f'{k}th ')}from {placement.get('offset', 0)}"
    if "start" in placement:
        return "all but the first" if placement["start"] == 1 else f"all from {placement['start']}"
    return flow(placement)


def flow(value) -> str:
    """A YAML value on one line, as variants.yaml writes it (``{every: 3, offset: 2}``)."""
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6)
    return text.strip().removesuffix("...").strip()     # a scalar's dump ends its document with "..."


def table(variants: dict) -> str:
    """The Markdown table of the variants, in the file's order (the tables' order)."""
    rows = ["| id | label | FFN kind | layers (0-based) | other keys |", "|---|---|---|---|---|"]
    for name, v in variants.items():
        other = ", ".join(f"`{k}: {flow(x)}`" for k, x in v.items() if k not in COLUMNS + PRESENTATION)
        rows.append(f"| `{name}` | {v['label']} | `{v['ffn']}` | {layers(v.get('placement'))} | {other or '-'} |")
    return "\n".join(rows)


def with_table(text: str, variants: dict) -> str:
    """``text`` with the part between the markers replaced by the table of ``variants``."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not (sep and sep2):
        raise ValueError(f"{DOC}: expected the markers {BEGIN!r} and {END!r} around the variant table")
    return f"{head}{BEGIN}\n{table(variants)}\n{END}{tail}"


if __name__ == "__main__":
    atomic_write_text(DOC, with_table(DOC.read_text(), variants_file()))
    print(f"{DOC.relative_to(L.REPO)}: {len(variants_file())} variants")
