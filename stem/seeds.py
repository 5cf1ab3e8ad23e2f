"""Several seeds of a matrix cell (torch-free; the Snakefile imports it through stem.config).

A config asks for seeds with ``seeds: [0, 1, 2]`` in a matrix entry (every variant of that scale), as
``seeds: {dense: [0, 1, 2], stem: [0, 1, 2]}`` there (per variant), or at the top level (the whole matrix;
a matrix entry's ``seeds`` wins). Seed 0 is the matrix's own job: its paths and job spec are unchanged. Seed
k > 0 is a job of its own, the variant id ``{variant}_seed{k}``: its own results folder
(``results/{experiment}/{scale}/{variant}_seed{k}/{stage}/``), the variant's model and settings, and the job
spec's ``seed`` = the config's ``seed`` + k (model initialisation and data order). One seed of one variant is
one target, e.g. ``snakemake results/tiny/350m/stem_seed2/pretrain/summary.json``.

A training job's identity is a ``JobId(scale, variant, stage, seed, sweep)``: ``str(job.slot)``, the variant id,
is its one string form in paths (``{variant}`` or ``{variant}_seed{k}``; a sweep point's id, ``rho_0p5``, is its
variant), and ``JobId.parse(scale, slot, stage)`` its one parser.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ID = re.compile(r"^(?P<base>[a-z][a-z0-9_]*?)_seed(?P<k>[1-9][0-9]*)$")
SWEEP_ID = re.compile(r"^(?P<kind>rho|slots)_[0-9][0-9p]*$")   # a sweep point (stem.sweeps.rho_id, slots_id)


@dataclass(frozen=True)
class JobId:
    """One training job: the matrix cell or sweep point (``variant``: a variant of config/variants.yaml, or a
    sweep point's id), its stage, and the seed index (0: the matrix's own job). ``sweep``: the sweep a point
    belongs to (rho, slots), None for a variant."""
    scale: str
    variant: str
    stage: str
    seed: int = 0
    sweep: str | None = None

    @classmethod
    def parse(cls, scale: str, slot: str, stage: str) -> "JobId":
        """The job whose path form (the ``{variant}`` wildcard) is ``slot``."""
        m, point = ID.match(slot), SWEEP_ID.match(slot)
        base, k = (m["base"], int(m["k"])) if m else (slot, 0)
        return cls(scale, base, stage, k, point["kind"] if point else None)

    @property
    def slot(self) -> str:
        """The string form in paths and wildcards: the variant id (``{variant}_seed{k}`` for seed k > 0)."""
        return self.variant if self.seed == 0 else f"{self.variant}_seed{self.seed}"


def seeds_of(exp, scale: str, variant: str) -> list[int]:
    """The seed indices the config (``exp``: its typed tree, stem.config.experiment.Experiment, read by attribute: this
    module is below it) runs for one matrix cell (always including 0, the matrix's own job)."""
    m = exp.matrix.get(scale)
    if m is None or variant not in m.variants:
        return [0]
    s = m.seeds if m.seeds is not None else exp.seeds
    if isinstance(s, dict):
        s = s.get(variant)
    return sorted({0, *(int(k) for k in s)}) if s else [0]

