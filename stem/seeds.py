"""Several seeds of a matrix cell (torch-free; the Snakefile imports it through stem.config).

A config asks for seeds with ``seeds: [0, 1, 2]`` in a matrix entry (every variant of that scale), as
``seeds: {dense: [0, 1, 2], stem: [0, 1, 2]}`` there (per variant), or at the top level (the whole matrix;
a matrix entry's ``seeds`` wins). Seed 0 is the matrix's own job: its paths and job spec are unchanged. Seed
k > 0 is a job of its own, the variant id ``{variant}_seed{k}``: its own results folder
(``results/{experiment}/{scale}/{variant}_seed{k}/{stage}/``), the variant's model and settings, and the job
spec's ``seed`` = the config's ``seed`` + k (model initialisation and data order). One seed of one variant is
one target, e.g. ``snakemake results/tiny/350m/stem_seed2/pretrain/summary.json``.
"""
from __future__ import annotations

import re

ID = re.compile(r"^(?P<base>[a-z][a-z0-9_]*?)_seed(?P<k>[1-9][0-9]*)$")


def seed_id(variant: str, k: int) -> str:
    """The variant id of seed ``k`` (seed 0: the variant itself)."""
    return variant if k == 0 else f"{variant}_seed{k}"


def split(variant: str) -> tuple[str, int]:
    """(base variant, seed index) of a variant id; (variant, 0) for a plain variant."""
    m = ID.match(variant)
    return (m["base"], int(m["k"])) if m else (variant, 0)


def seeds_of(exp, scale: str, variant: str) -> list[int]:
    """The seed indices the config (``exp``: its typed tree, stem.experiment.Experiment, read by attribute: this
    module is below it) runs for one matrix cell (always including 0, the matrix's own job)."""
    m = exp.matrix.get(scale)
    if m is None or variant not in m.variants:
        return [0]
    s = m.seeds if m.seeds is not None else exp.seeds
    if isinstance(s, dict):
        s = s.get(variant)
    return sorted({0, *(int(k) for k in s)}) if s else [0]

