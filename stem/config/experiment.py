"""The experiment config as one typed tree: each key's type, default and range written once, here.

``parse(mapping, origin)`` reads a config (config/tiny.yaml, paper.yaml, ...) into frozen dataclasses whose
fields are typed with the option lists of ``stem.options``; mappings keyed by scale, stage, source or variant
stay dicts of typed nodes. A wrong key, type or value is one ``ConfigError`` line naming the file, the key,
the value and what is expected. A node checks what it knows in ``__post_init__`` (a stage's mixture sums to 1,
a tokenizer of kind train_bpe has sources); ``Experiment.__post_init__`` checks what crosses sections (the
variants and sources a section names exist, a stage's ``init_from`` is an earlier stage of the matrix, ...).

Adding a key is one field on its node: its type, its default (``None``: not set), its range as
``metadata=expect(...)``; a suite key is one field on its kind's settings class (stem.eval.spec.SuiteSettings,
``Experiment.suite_settings``). Sections a plugin defines its own keys for (``eval`` as a whole, ``report``,
another analysis, a source kind's reader keys) stay mappings handed on as they are.
Torch-free (the workflow's DAG build parses the config).
"""
from __future__ import annotations

import dataclasses
import math
import re
import typing
from dataclasses import dataclass, field

from stem import fields, knowledge, plugins, sweeps
from stem.fields import FieldError, Parser, expect
from stem.io import ConfigError, dataclass_mapping, read_yaml, variants_file
from stem.optim import Group, OptimSpec
from stem.options import (CKATokens, Device, DocKeys, DSEMode, Experiment as ExperimentName, InsertInit, NameKind,
                          RopeKind, RopeRamp, Scale, SourceKind, Stage, TableInit, TableLayout,
                          TokenizerKind, Truncation, values)
from stem.registry import ANALYSES, GENERATORS, SUITE_KINDS   # names only: entries load on use
from stem.specs import (VARIANT_FILE, Insert, Layout, RunSettings, StageOptions, StageSchedule,
                        TrainCalibration, Variant, variants)  # noqa: F401 (C.experiment.TrainCalibration)

NAME = re.compile(r"^[a-z][a-z0-9_]*$")                                  # a variant's name
MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")   # a plugin module


# ---- ranges: a field's metadata (stem.fields.expect) -----------------------------------------------------
def at_least(n, what: str = "an integer") -> dict:
    return expect(lambda v: v >= n, f"{what} >= {n}")


def above(n) -> dict:
    return expect(lambda v: v > n, f"a number > {n}")


def within(lo, hi, open_hi: bool = False) -> dict:
    return expect(lambda v: lo <= v < hi if open_hi else lo <= v <= hi,
                  f"a number in [{lo}, {hi}{')' if open_hi else ']'}")


def items(n: int, what: str = "items") -> dict:
    return expect(lambda v: len(v) >= n, f"at least {n} {what}")


def matches(pattern: re.Pattern, what: str) -> dict:
    return expect(lambda v: all(pattern.match(x) for x in ([v] if isinstance(v, str) else v)), what)


POSITIVE = at_least(1)


# ---- the parser: a mapping into a node, each key checked against its field's type (stem.fields) ----------
CONFIG = Parser(ConfigError, wrong="key '{key}': {value}; expected {expected}",
                unknown="key '{key}': unknown; expected one of {names}")


def convert(tp, value, key: str):
    """``value`` as type ``tp`` (``stem.fields.convert``); ConfigError ``key 'a.b': ...`` otherwise."""
    return fields.convert(tp, value, key, CONFIG)


def node(cls, d, key: str = ""):
    """Build node ``cls`` from mapping ``d`` found at ``key`` (``stem.fields.node``): unknown and missing keys,
    types, ranges (``expect`` metadata), then the node's own checks; ConfigError ``key 'a.b': ...`` otherwise."""
    return fields.node(cls, d, key, CONFIG)


def override(obj, over, key: str = ""):
    """Node ``obj`` with mapping ``over``'s keys set over its own (``stem.fields.override``: typed and checked as
    ``node``, ``dataclasses.replace``); ConfigError ``key 'a.b': ...`` otherwise. A variant's and a sweep's
    overrides of the config's nodes (stem.config.train_job)."""
    return fields.override(obj, over, key, CONFIG)


def fail(ok: bool, key: str, problem: str):
    """A node's own check: ``FieldError`` naming ``key`` (under the node's own key) unless ``ok``."""
    if not ok:
        raise FieldError(key, problem)


# ---- the nodes, leaves first ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Arch:
    """``archs.<scale>``: the backbone (stem.models.spec.ModelConfig's architecture keys)."""
    vocab_size: int = field(metadata=at_least(2))
    d_model: int = field(metadata=POSITIVE)
    n_layers: int = field(metadata=POSITIVE)
    n_heads: int = field(metadata=POSITIVE)
    n_kv_heads: int = field(metadata=POSITIVE)
    d_ff: int = field(metadata=POSITIVE)
    max_seq_len: int = field(metadata=POSITIVE)
    rope_theta: float | None = field(default=None, metadata=above(0))
    norm_eps: float | None = None
    init_std: float | None = None
    table_init: TableInit | None = None
    table_init_std: float | None = None
    tie_embeddings: bool | None = None


@dataclass(frozen=True)
class RopeScaling:
    """A stage's ``rope_scaling`` (stem.models.rope): a longer context than pre-training's."""
    kind: RopeKind
    theta: float | None = None
    low_freq_factor: float | None = None    # llama3
    high_freq_factor: float | None = None   # llama3
    factor: float | None = field(default=None, metadata=at_least(1, "a number"))
    original_max_seq_len: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    ramp: RopeRamp | None = None


@dataclass(frozen=True)
class HFInit:
    """A stage's ``init_from: {hf: <hub id or folder>, gguf_file: <file in it>}``: a transformers checkpoint
    (stem.hf.importer; the folder may be a package resource pkg:NAME), a GGUF file in it dequantised."""
    hf: str
    gguf_file: str | None = field(default=None, metadata=matches(re.compile(r"^[^/#]+$"), "a file name"))


@dataclass(frozen=True, kw_only=True)
class StageSettings(StageOptions, StageSchedule):
    """``stages.<stage>.<scale>``: one stage's data mixture, and its schedule and batch layout (lr, schedule,
    warmup, min_lr_ratio, batch_size, micro_batch, seq_len, steps: ``stem.specs.StageSchedule``) and options
    (cross_doc_mask, reset_optimizer, schedule_steps, activation_checkpointing: ``stem.specs.StageOptions``), the
    same fields a training job's spec has."""
    data: dict[str, float] = field(metadata=expect(lambda d: len(d) >= 1 and all(w > 0 for w in d.values()),
                                                   "a mapping of at least one source to a weight > 0"))
    # a stage name, or {hf: ...}: a transformers checkpoint (HFInit)
    init_from: Stage | HFInit | None = None
    # this stage's table-group optimizer settings over optim.groups.table (stem.optim.adamw)
    table_group: Group | None = None
    max_seq_len: int | None = field(default=None, metadata=POSITIVE)
    rope_scaling: RopeScaling | None = None

    def __post_init__(self):
        total = sum(self.data.values())
        fail(math.isclose(total, 1.0, abs_tol=1e-6), "data", f"mixture weights sum to {total:g}, expected 1")
        fail(self.batch_size % self.micro_batch == 0, "micro_batch",
             f"{self.micro_batch} does not divide batch_size {self.batch_size}")
        fail(not (isinstance(self.init_from, HFInit) and self.reset_optimizer is False), "reset_optimizer",
             f"false needs a stage's optimizer state; init_from {self.init_from_mapping} is a transformers checkpoint "
             "(it has none)")
        fail(not (self.init_from is None and self.reset_optimizer is False), "reset_optimizer",
             "false needs an init_from stage whose optimizer state it carries")
        fail(self.steps > 0 or isinstance(self.init_from, HFInit), "steps", "0 is a stage that only imports a "
             f"transformers checkpoint; expected init_from: {{hf: ...}} (it is {self.init_from_mapping!r}) "
             "or steps >= 1")

    @property
    def init_from_mapping(self) -> dict | None:
        """``init_from`` as the config writes it, for messages."""
        i = self.init_from
        return dataclass_mapping(i) if isinstance(i, HFInit) else None if i is None else str(i)


SEED_LIST = expect(lambda s: len(s) >= 1 and len(set(s)) == len(s) and all(k >= 0 for k in s),
                   "a non-empty list of distinct seed indices >= 0")


@dataclass(frozen=True)
class MatrixEntry:
    """``matrix.<scale>``: the variants trained at a scale, their stages, and their seeds (stem.seeds)."""
    variants: tuple[str, ...] = field(metadata=expect(lambda v: len(v) >= 1 and all(NAME.match(x) for x in v),
                                                      "a non-empty list of variant names"))
    stages: tuple[Stage, ...] = field(metadata=items(1, "stages"))
    seeds: tuple[int, ...] | dict[str, tuple[int, ...]] | None = field(default=None, metadata=expect(
        lambda s: all(SEED_LIST["ok"](x) for x in (s.values() if isinstance(s, dict) else [s])),
        f"{SEED_LIST['expected']} (or a mapping of variants to one)"))


@dataclass(frozen=True)
class Tokenizer:
    """``tokenizer.<scale>``: a BPE trained on some sources, or a pretrained one's file."""
    kind: TokenizerKind
    path: str | None = None
    gguf_file: str | None = None   # kind pretrained: the tokenizer of this GGUF file in the folder ``path``
    sources: tuple[str, ...] | None = field(default=None, metadata=items(1, "sources"))
    vocab_size: int | None = field(default=None, metadata=at_least(260))
    # the knowledge experiment: the knowledge section's one-token names added as tokens (stem.data.bios)
    add_names: bool | None = None

    def __post_init__(self):
        for key in ("sources", "vocab_size") if self.kind == TokenizerKind.TRAIN_BPE else ("path",):
            fail(getattr(self, key) is not None, key, f"missing (needed by kind {self.kind})")


@dataclass(frozen=True)
class World:
    """``world``: the synthetic world's size and seed (stem.data.synth)."""
    seed: int | None = None
    n_countries: int | None = field(default=None, metadata=POSITIVE)
    n_people: int | None = field(default=None, metadata=POSITIVE)
    n_filler: int | None = field(default=None, metadata=POSITIVE)


SAMPLE_RANGE = expect(lambda r: all(0 <= x <= 1 for lo_hi in (r.values() if isinstance(r, dict) else [r])
                                    for x in lo_hi), "a [lo, hi) range within [0, 1] (or a mapping of scales to one)")


@dataclass(frozen=True)
class Source:
    """``sources.<name>``: a source of documents. The keys of its kind's reader (paths, format, a generator's
    own sizes, ...) stay in ``reader``, handed on as written (stem.data.sources)."""
    EXTRA: typing.ClassVar[str] = "reader"
    kind: SourceKind
    generator: str | None = None      # kind synth: a registered generator (stem.registry.GENERATORS)
    bytes: float | None = field(default=None, metadata=at_least(1, "a number"))
    max_tokens: float | None = field(default=None, metadata=at_least(1, "a number"))
    parts: int | None = field(default=None, metadata=POSITIVE)          # scattered tokenize jobs
    doc_keys: DocKeys | None = None                                     # what the val split and sampling hash
    val_fraction: float | None = field(default=None, metadata=within(0, 1, open_hi=True))   # held-out share
    # keep documents whose uniform is in [lo, hi) (per scale)
    sample: tuple[float, float] | dict[Scale, tuple[float, float]] | None = field(default=None, metadata=SAMPLE_RANGE)
    reader: dict = field(default_factory=dict)

    def __post_init__(self):
        fail(self.generator is None or self.kind != SourceKind.SYNTH or self.generator in GENERATORS, "generator",
             f"unknown generator {self.generator!r}; expected one of {', '.join(GENERATORS)}")


# ``optim``: AdamW's settings, and a stage's ``table_group``: the job spec's own classes (stem.optim), one
# declaration from the YAML to the optimizer; a variant's ``optim:`` is set over them (stem.fields.override).
Optim = OptimSpec


# ``train``: logging, evaluation and checkpoint intervals of every training job: the job spec's own class
# (stem.specs.RunSettings, its defaults and ranges), one declaration from the YAML to the loop.
Train = RunSettings


@dataclass(frozen=True)
class TrainJob:
    """``cluster.train.<scale>``: a training job's Slurm size."""
    nodes: int = field(metadata=POSITIVE)
    gpus_per_node: int = field(metadata=at_least(0))
    runtime: int = field(metadata=POSITIVE)
    cpus_per_gpu: int | None = field(default=None, metadata=POSITIVE)
    mem_mb_per_gpu: int | None = field(default=None, metadata=POSITIVE)
    cpus: int | None = field(default=None, metadata=POSITIVE)
    mem_mb: int | None = field(default=None, metadata=POSITIVE)

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class Job:
    """``cluster.eval`` / ``cluster.cpu`` / ``cluster.tokenize``: the Slurm size of one job of that kind."""
    runtime: int | None = field(default=None, metadata=POSITIVE)
    gpus: int | None = field(default=None, metadata=at_least(0))
    cpus: int | None = field(default=None, metadata=POSITIVE)
    mem_mb: int | None = field(default=None, metadata=POSITIVE)

    def size(self) -> dict:
        """The Slurm resources it sets of ``mem_mb`` and ``runtime``."""
        return {k: getattr(self, k) for k in ("mem_mb", "runtime") if getattr(self, k) is not None}


@dataclass(frozen=True)
class Cluster(Layout):
    """``cluster``: Slurm resources per job kind (rules/common.smk) and the training jobs' parallel layout
    (``stem.specs.Layout``, the job spec's own class: ``strategy`` (its ``parallel``), ``tables``, ``host_workers``,
    ``host_mem_gbs``, ``host_core_gbs``)."""
    KEYS: typing.ClassVar[dict] = {"parallel": "strategy"}   # written ``strategy`` here (stem.fields.key_of)
    partition: str | None = None
    account: str | None = None
    constraint: str | None = None
    gpu_mem_gib: float | None = field(default=None, metadata=above(0))   # per-GPU budget for a job's traced peak
    fit_memory: bool = False   # true: each job's plan picks the micro-batch, checkpointing, host tables that fit
    state_write_mb_s: float = field(default=500, metadata=above(0))   # MB/s one node writes a checkpoint at
    stop_margin_s: int = field(default=120, metadata=at_least(0))      # seconds on top of the write (stop warning)
    train: dict[Scale, TrainJob] = field(default_factory=dict)
    eval: Job | None = None
    cpu: Job | None = None
    tokenize: Job | None = None

    def __post_init__(self):
        fail(not self.fit_memory or self.gpu_mem_gib is not None, "fit_memory",
             "true fits each training job to cluster.gpu_mem_gib; expected cluster.gpu_mem_gib set (GiB per GPU)")
        for scale, t in self.train.items():   # host tables: one host's memory, jobs of one GPU (ParallelPlan.of)
            fail(self.tables != TableLayout.HOST or t.gpus <= 1, "tables",
                 f"host keeps the tables in one host's memory, for jobs of one GPU; cluster.train.{scale} gives "
                 f"{t.nodes} x {t.gpus_per_node} GPUs (expected rows or fsdp)")
        fail(self.host_workers is None or self.tables == TableLayout.HOST or self.fit_memory, "host_workers",
             f"{self.host_workers} overlaps the host tables' update; expected cluster.tables: host (or "
             "cluster.fit_memory: true, which may choose them), or no host_workers")
        for key in ("eval", "cpu"):
            fail(getattr(self, key) is None or getattr(self, key).runtime is not None, f"{key}.runtime",
                 "missing (expected an integer)")

    def job(self, kind: str) -> Job:
        """The size of a job kind (eval, cpu, tokenize); an unset one is empty."""
        return getattr(self, kind) or Job()


# ---- analyses (rules/analyze.smk, stem/analysis) --------------------------------------------------------
AnalysisStages = dict[Scale, tuple[Stage, ...]]   # {scale: [stage]}: the checkpoints an analysis reads


@dataclass(frozen=True)
class Editing:
    relations: dict[str, tuple[str, ...]]
    pairs_per_case: int = field(metadata=at_least(0))
    collateral: int = field(metadata=at_least(0))
    known_entities: int = field(metadata=POSITIVE)
    topk: int = field(metadata=POSITIVE)
    seed: int
    facts: str | None = None
    stages: AnalysisStages | None = None   # this analysis's checkpoints (default analysis.stages)
    every_source: bool | None = None       # one edit per entity of the facts (besides pairs_per_case's draw)
    first_token: bool | None = None        # candidates scored by their first token (one forward per prompt)
    example: dict | None = None


@dataclass(frozen=True)
class HFParity:
    """stem/analysis/hf_parity.py: the export-hf folder under lm-eval's stock hf model."""
    facts: str                                              # the prompt set the lm-eval task is made from
    tolerance: float = field(metadata=above(0))             # max |loglikelihood difference| (nats) accepted
    stages: AnalysisStages | None = None


@dataclass(frozen=True)
class InsertCalibration:
    """Init ``calibrated``'s settings (stem.models.calibrate): calibration tokens of the source's train split, the
    rule for tokens it never saw, layer after layer or not, the one-layer-at-a-time decomposition rows."""
    tokens: int = field(default=16384, metadata=POSITIVE)
    unseen: str = field(default="mean", metadata=expect(lambda v: v in ("mean", "raw"), "mean or raw"))
    sequential: bool = False
    per_layer: bool | tuple[str, ...] = False   # true: every STEM layer of the placements; a list: those placements'
    compare: tuple[str, ...] = ()   # placements where the other choices (unseen mean / raw x sequential) are measured


@dataclass(frozen=True)
class InsertionStep0:
    """stem/analysis/insertion.py: STEM inserted into a dense checkpoint, at step 0."""
    source: str
    windows: int = field(metadata=POSITIVE)
    seq_len: int = field(metadata=at_least(2))
    placements: dict = field(metadata=items(1, "placements"))   # name -> a placement ({every, offset}, {start}, a list)
    inits: tuple[InsertInit, ...] = field(metadata=items(1, "inits"))
    seed: int | None = None
    # init ``calibrated`` (stem.models.calibrate): {tokens, unseen: mean | raw, sequential, per_layer}, read from the
    # source's train split (the same tokenizer as ``source``)
    calibration: InsertCalibration | None = None

    def __post_init__(self):
        cal = self.calibration
        for key in ("per_layer", "compare"):
            names = getattr(cal, key) if cal is not None and not isinstance(getattr(cal, key), bool) else ()
            unknown = [n for n in names if n not in self.placements]
            fail(not unknown, f"calibration.{key}", f"{unknown[0]!r} is not a placement; expected some of "
                 f"{', '.join(self.placements)}" if unknown else "")


@dataclass(frozen=True)
class Heaps:
    source: str
    lengths: tuple[int, ...] = field(metadata=expect(lambda v: len(v) >= 2 and min(v) >= 1,
                                                     "at least 2 lengths >= 1"))
    windows: int = field(metadata=POSITIVE)


@dataclass(frozen=True)
class Spread:
    source: str
    n_tokens: int = field(metadata=at_least(2))
    window: int | None = field(default=None, metadata=at_least(2))


@dataclass(frozen=True)
class Capacity:
    source: str
    countries: int = field(metadata=POSITIVE)
    people: int = field(metadata=POSITIVE)
    choices: int = field(metadata=at_least(2))
    seed: int


@dataclass(frozen=True)
class Windows:
    """``analysis.heldout`` / ``analysis.logitlens``: windows of a source's held-out documents."""
    source: str
    windows: int = field(metadata=POSITIVE)
    seq_len: int = field(metadata=POSITIVE)
    batch: int | None = field(default=None, metadata=POSITIVE)
    baseline: str | None = field(default=None, metadata=matches(NAME, "a variant name"))


@dataclass(frozen=True)
class CKA:
    source: str
    windows: int = field(metadata=POSITIVE)
    seq_len: int = field(metadata=POSITIVE)
    tokens: CKATokens
    n_tokens: int = field(metadata=at_least(4))
    batch: int = field(metadata=at_least(4))
    topk: int = field(metadata=POSITIVE)
    baseline: str | None = field(default=None, metadata=matches(NAME, "a variant name"))


@dataclass(frozen=True)
class WorldProbe:
    items: int = field(metadata=POSITIVE)
    choices: int = field(metadata=at_least(2))
    seed: int


@dataclass(frozen=True)
class DSEDisabled:
    suite: str
    categories: dict[str, tuple[str, ...]] = field(metadata=expect(
        lambda c: len(c) >= 1 and all(len(t) >= 1 for t in c.values()), "a mapping of categories to task lists"))
    modes: tuple[DSEMode, ...] = field(metadata=items(1, "modes"))
    limit: int | None = field(default=None, metadata=POSITIVE)
    world_probe: WorldProbe | None = None


@dataclass(frozen=True)
class Analysis:
    """``analysis``: the checkpoints' stages and each built-in analysis's settings; a plugin's analysis keeps
    its section as written (``plugins``: name -> mapping, handed to the analysis)."""
    EXTRA: typing.ClassVar[str] = "plugins"
    stages: AnalysisStages = field(default_factory=dict)
    editing: Editing | None = None
    heaps: Heaps | None = None
    spread: Spread | None = None
    capacity: Capacity | None = None
    hf_parity: HFParity | None = None
    insertion_step0: InsertionStep0 | None = None
    heldout: Windows | None = None
    logitlens: Windows | None = None
    cka: CKA | None = None
    dse_disabled: DSEDisabled | None = None
    plugins: dict = field(default_factory=dict)

    def sections(self) -> dict:
        """{analysis name: its settings node (or a plugin's mapping)} for the analyses the config sets."""
        built = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("stages", "plugins")}
        return {**{k: v for k, v in built.items() if v is not None}, **self.plugins}


# ---- the sweeps (stem.sweeps) ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerance:
    p_tot: float | None = field(default=None, metadata=at_least(0, "a number"))
    p_act: float | None = field(default=None, metadata=at_least(0, "a number"))


@dataclass(frozen=True)
class SweepTrain:
    """``sweeps.train``: the stage's settings every sweep point overrides."""
    steps: int | None = field(default=None, metadata=POSITIVE)
    eval_batches: int | None = field(default=None, metadata=POSITIVE)


VARIANT = matches(NAME, "a variant name")


@dataclass(frozen=True)
class RhoSweep:
    base: str = field(metadata=VARIANT)       # the rho = 1 pure MoE model (ffn moe)
    memory: str = field(metadata=VARIANT)     # whose dse: section the hybrids get
    values: tuple[float, ...] = field(metadata=expect(lambda v: len(v) >= 2 and all(0 <= x <= 1 for x in v),
                                                      "at least 2 numbers in [0, 1]"))
    base_overrides: dict | None = None        # merged over the base (e.g. moe_experts), for the sweep only
    dse: dict | None = None                   # merged over the memory's dse: section
    tolerance: Tolerance | None = None        # |relative deviation| from the rho = 1 model's


@dataclass(frozen=True)
class SlotsSweep:
    base: str = field(metadata=VARIANT)       # the fixed backbone (no dse: section)
    memory: str = field(metadata=VARIANT)
    rows_per_head: tuple[int, ...] = field(metadata=expect(lambda v: len(v) >= 2 and min(v) >= 2,
                                                           "at least 2 integers >= 2"))
    base_overrides: dict | None = None
    dse: dict | None = None


@dataclass(frozen=True)
class Sweeps:
    """``sweeps``: the DSE paper's Sec. 3 sweeps (stem/sweeps.py, rules/sweep.smk)."""
    scale: Scale
    stage: Stage
    in_all: bool = False    # true: `rule all` and the report's figures include both sweeps
    train: SweepTrain | None = None
    rho: RhoSweep | None = None
    slots: SlotsSweep | None = None


# ---- the knowledge experiment (stem.knowledge, stem.data.bios) ---------------------------------------------
@dataclass(frozen=True)
class KnowledgeTrain:
    """``knowledge.train``: the stage settings the points set over ``stages.<stage>.<scale>``'s (beside their data
    and steps): a config whose stage serves its matrix too (tiny) gives its points their own optimisation."""
    lr: float | None = field(default=None, metadata=above(0))
    batch_size: int | None = field(default=None, metadata=POSITIVE)
    micro_batch: int | None = field(default=None, metadata=POSITIVE)
    seq_len: int | None = field(default=None, metadata=POSITIVE)

    def settings(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass(frozen=True)
class Knowledge:
    """``knowledge``: the bioS-style world (a pool of ``names`` individuals, attributes with known set sizes,
    paraphrase templates) and the sweep over its sources (each a world of N individuals seen E times) x variants
    x seeds, every point a generated variant id trained by the train rule at ``scale`` / ``stage``."""
    seed: int
    names: int = field(metadata=at_least(2))                   # the name vocabulary (one-token names)
    attributes: dict[str, int] = field(metadata=expect(lambda a: len(a) >= 1 and min(a.values()) >= 2,
                                                       "a mapping of attributes to set sizes >= 2"))
    templates: dict[str, tuple[str, ...]]
    sources: tuple[str, ...] = field(metadata=items(1, "sources"))   # bios sources: the N sweep (and the control)
    variants: tuple[str, ...] = field(metadata=items(1, "variants"))
    scale: Scale
    stage: Stage
    tokens_per_bio: float = field(metadata=above(0))          # measured (docs/knowledge.md): sets the steps
    # the points' own tokenizer (the names added as tokens), keyed by the section, not by a scale (stem.layout
    # KNOWLEDGE): the points keep the scale's architecture with ``vocab_size`` (default the scale's) over it
    tokenizer: Tokenizer
    name_kind: NameKind = NameKind.ONE
    seeds: tuple[int, ...] = (0,)                              # seed k > 0: its own job (exp.seed + k)
    seeds_at: tuple[str, ...] | None = None                    # sources whose points get every seed (default all)
    seeds_for: tuple[str, ...] | None = None                   # variants that get them there (default all)
    # a source's own variants (default ``variants``): e.g. the editing world without the variants no direction row
    # reads there (docs/knowledge.md "Sixth config")
    variants_at: dict[str, tuple[str, ...]] | None = None
    min_recall: float = field(default=0.9, metadata=within(0, 1))   # below it at the smallest N: invalid
    # the training budget below which the smallest world is not learnt (docs/knowledge.md: measured, dense at
    # N 100 recalls 0.97 at E 100); a source with fewer exposures fails the config check
    min_exposures: int = field(default=100, metadata=POSITIVE)
    # a floor on a point's optimizer steps (docs/knowledge.md: one pass over a small world is too few steps to
    # learn it; above the floor a point trains for one pass)
    min_steps: int = field(default=1, metadata=POSITIVE)
    vocab_size: int | None = field(default=None, metadata=at_least(260))   # the points' vocabulary (the arch's)
    train: KnowledgeTrain | None = None                        # the points' stage settings (default the stage's)
    # pair names (a source's name_kind pair): each of the two pools' words (default ceil(sqrt(names)) + 2), and the
    # tokens of a biography with pair names (measured; default tokens_per_bio): their points' steps
    pair_pool: int | None = field(default=None, metadata=at_least(2))
    pair_tokens_per_bio: float | None = field(default=None, metadata=above(0))
    # the capacity sweep: the name kind of the sources whose smallest world decides validity, whose worlds get the
    # STEM/dense bits ratio rows and the figure's lines (docs/knowledge.md: one-token names do not saturate)
    capacity_names: NameKind = NameKind.ONE
    # how many of the pool's one-token names (its first) the tokenizer adds as tokens (default all ``names``): the
    # one-token worlds and their injected individuals must fit in them; the rest of the pool is only ever named by
    # pairs, so their tokens would be vocabulary (and LM-head rows) no text reads (docs/knowledge.md "Sixth config")
    name_tokens: int | None = field(default=None, metadata=at_least(1))

    def __post_init__(self):
        fail(set(self.templates) == set(self.attributes), "templates",
             f"attributes {sorted(self.templates)}; expected one template list per attribute {sorted(self.attributes)}")
        for attr, tpls in self.templates.items():
            fail(len(tpls) >= 1, f"templates.{attr}", "empty; expected at least one template")
            for i, t in enumerate(tpls):
                problem = knowledge.template_problem(t)
                fail(problem is None, f"templates.{attr}[{i}]", problem or "")


# ---- the root ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Experiment:
    """An experiment config (config/{tiny,paper,rehearsal}.yaml)."""
    experiment: ExperimentName
    seed: int
    device: Device
    archs: dict[Scale, Arch] = field(metadata=items(1, "scales"))
    matrix: dict[Scale, MatrixEntry]
    tokenizer: dict[Scale, Tokenizer]
    sources: dict[str, Source] = field(metadata=items(1, "sources"))
    optim: Optim
    stages: dict[Stage, dict[Scale, StageSettings]]
    train: Train
    seeds: tuple[int, ...] | None = field(default=None, metadata=SEED_LIST)   # every matrix cell (stem.seeds)
    # variants of config/variants.yaml: keys merged over theirs (a variant's model keys, checked below)
    variant_overrides: dict[str, dict] = field(default_factory=dict, metadata=matches(NAME, "variant names"))
    world: World | None = None
    cluster: Cluster = field(default_factory=Cluster)
    analysis: Analysis | None = None
    eval: dict | None = None       # suites of registered kinds, each with its kind's own keys (stem.eval.spec)
    report: dict | None = None     # the aggregate stage's settings (stem.specs.ReportSpec.from_config checks them)
    # the config's own plugin modules (stem.plugins): imported before anything is looked up
    plugins: tuple[str, ...] = field(default=(), metadata=matches(MODULE, "importable module names"))
    sweeps: Sweeps | None = None
    knowledge: Knowledge | None = None   # the knowledge experiment (stem.knowledge)

    def __post_init__(self):
        if self.knowledge is not None:
            knowledge.validate(self)
        self._check_variant_names()
        self._check_suites()
        self._check_sources()
        self._check_long_context()
        for name, spec in self.analysis.plugins.items() if self.analysis else ():   # a plugin's analysis
            fail(name in ANALYSES, f"analysis.{name}", f"unknown analysis; expected stages or one of "
                 f"{', '.join(ANALYSES)}")
            fail(isinstance(spec, dict), f"analysis.{name}", f"{spec!r}; expected a mapping")
        for name, spec in self.variants().items():
            self._check_variant(name, spec)
        baseline_variant(self.variant_overrides)   # exactly one, the overrides included
        for scale, m in self.matrix.items():
            self._check_cell(scale, m)
        for scale, tok in self.tokenizer.items():
            if scale in self.matrix and tok.kind == TokenizerKind.TRAIN_BPE:
                fail(tok.vocab_size <= self.archs[scale].vocab_size, f"tokenizer.{scale}.vocab_size",
                     f"{tok.vocab_size} exceeds archs.{scale}.vocab_size {self.archs[scale].vocab_size}")

    def variants(self) -> dict[str, Variant]:
        """{name: Variant} of config/variants.yaml with this config's variant_overrides, in the file's order
        (stem.specs.variants: parsed once per file version and overrides)."""
        return variants(self.variant_overrides)

    def variant_names(self) -> tuple[str, ...]:
        """The named variants (config/variants.yaml's, in its order), without parsing them: the checks of the names
        a config gives run before the variants' own (``_check_variant``)."""
        return tuple(variants_file())

    def variant(self, name: str) -> Variant | None:
        """One variant (None for a name config/variants.yaml does not define)."""
        return self.variants().get(name)

    def _check_variant_names(self):
        """Every variant the config names is one of config/variants.yaml."""
        known = self.variant_names()
        named = [(f"matrix.{s}.variants", v) for s, m in self.matrix.items() for v in m.variants]
        named += [(f"variant_overrides.{v}", v) for v in self.variant_overrides]
        named += [(f"analysis.{a}.baseline", spec.baseline) for a, spec in self.analyses().items()
                  if getattr(spec, "baseline", None) is not None]
        named += [(f"analysis.{a}.baseline", spec["baseline"]) for a, spec in self.analyses().items()
                  if isinstance(spec, dict) and "baseline" in spec]
        for key, v in named:
            fail(v in known, key, f"{v!r} is not a variant of config/variants.yaml; expected one of {', '.join(known)}")

    def analyses(self) -> dict:
        return self.analysis.sections() if self.analysis else {}

    def _check_sources(self):
        """Every source a mixture, a tokenizer (the knowledge section's too), an eval suite the matrix runs or an
        analysis uses is defined."""
        uses = [(f"stages.{stage}.{scale}.data", list(spec.data))
                for stage, by_scale in self.stages.items() for scale, spec in by_scale.items()]
        uses += [(f"tokenizer.{scale}.sources", tok.sources or []) for scale, tok in self.tokenizer.items()]
        if self.knowledge is not None:
            uses.append(("knowledge.tokenizer.sources", self.knowledge.tokenizer.sources or []))
        ev = self.eval or {}
        run = {suite for m in self.matrix.values() for stage in m.stages
               for suite in (ev.get("stages") or {}).get(stage) or []}
        uses += [(f"eval.suites.{name}.{settings.SOURCES}", settings.sources())
                 for name, settings in self.suite_settings().items() if name in run]
        uses += [(f"analysis.{name}.source", [a["source"] if isinstance(a, dict) else a.source])
                 for name, a in self.analyses().items()
                 if (isinstance(a, dict) and "source" in a) or getattr(a, "source", None) is not None]
        for key, names in uses:
            unknown = [s for s in names if s not in self.sources]
            fail(not unknown, key, f"unknown source {unknown[0]!r}; expected one of {sorted(self.sources)}"
                 if unknown else "")

    def _check_suites(self):
        """Every eval suite's kind (default lm_eval) is a registered one (stem.registry.SUITE_KINDS) and its keys
        are those its kind's settings class declares (stem.eval.spec.SuiteSettings: types, ranges, the kind's
        own checks and its checks against the rest of the config)."""
        fail(isinstance(self.eval or {}, dict), "eval", f"{self.eval!r}; expected a mapping")
        for name, settings in self.suite_settings().items():
            try:
                settings.check(self)
            except FieldError as e:
                raise FieldError(f"eval.suites.{name}.{e.field}", str(e)) from None

    def suite_settings(self) -> dict:
        """{suite name: its settings node}, each of the class its kind registers (``SuiteKind.settings``); a key
        the kind does not declare is one line naming the suite, the key, the kind and the keys it accepts."""
        out = {}
        for name, suite in ((self.eval or {}).get("suites") or {}).items():
            where = f"eval.suites.{name}"
            fail(isinstance(suite, dict), where, f"{suite!r}; expected a mapping (kind: <suite kind>, its keys)")
            kind = suite.get("kind", "lm_eval")
            fail(kind in SUITE_KINDS, f"{where}.kind",
                 f"unknown suite kind {kind!r}; expected one of {sorted(SUITE_KINDS)}")
            cls = SUITE_KINDS[kind].settings
            accepted = [f.name for f in dataclasses.fields(cls) if f.init]
            unknown = [] if getattr(cls, "EXTRA", None) else sorted(set(suite) - set(accepted))
            fail(not unknown, f"{where}.{unknown[0] if unknown else ''}",
                 f"not a key of suite kind {kind} (it would be ignored); expected one of {', '.join(accepted)}")
            out[name] = node(cls, suite, where)
        return out

    def _check_long_context(self):
        """The long-context evaluation's keys (the DSE paper's Table 2): a suite's ``variants`` (only those variants'
        checkpoints get it) and ``metadata``, and the fixtures' RULER stand-in (``eval.fixtures.ruler``: the scale
        whose tokenizer sizes its items, lengths, generation room)."""
        ev, known = self.eval or {}, set(self.variant_names())
        whole = lambda v, lo: isinstance(v, int) and not isinstance(v, bool) and v >= lo   # noqa: E731
        for name, suite in (ev.get("suites") or {}).items():
            where = f"eval.suites.{name}"
            fail("variants" not in suite or (isinstance(suite["variants"], list) and suite["variants"]
                                             and set(suite["variants"]) <= known),
                 f"{where}.variants", f"{suite.get('variants')!r}; expected a non-empty list of variants of "
                 "config/variants.yaml")
            fail("metadata" not in suite or isinstance(suite["metadata"], dict), f"{where}.metadata",
                 f"{suite.get('metadata')!r}; expected a mapping (e.g. {{max_seq_lengths: [32768]}})")
        ruler = (ev.get("fixtures") or {}).get("ruler")
        if ruler is None:
            return
        scale = ruler.get("scale") if isinstance(ruler, dict) else ruler
        fail(isinstance(ruler, dict) and scale in self.tokenizer, "eval.fixtures.ruler.scale",
             f"{scale!r}; expected a scale of the config's tokenizer section ({', '.join(self.tokenizer)})")
        lengths = ruler.get("lengths")
        fail(isinstance(lengths, list) and bool(lengths) and all(whole(n, 2) for n in lengths),
             "eval.fixtures.ruler.lengths", f"{lengths!r}; expected a non-empty list of token counts >= 2")
        fail(whole(ruler.get("max_gen_toks"), 1), "eval.fixtures.ruler.max_gen_toks",
             f"{ruler.get('max_gen_toks')!r}; expected an integer >= 1")

    def _check_variant(self, name: str, v: Variant):
        """A variant's optim keys set over the config's, its insertion's source and calibration (what crosses
        sections; the node checked its own keys when it was parsed, stem.specs.Variant); found here, not when a
        job builds it."""
        where = f"variant '{name}' ({VARIANT_FILE})"
        try:
            if v.optim is not None:
                override(self.optim, v.optim, "optim")
            if v.insert is not None:
                self._check_insert(v.insert)
        except (ConfigError, FieldError) as e:
            raise ConfigError(f"{where}: {e if isinstance(e, ConfigError) else f'key {e.field!r}: {e}'}") from None

    def _check_insert(self, ins: Insert):
        """A mid-training insertion (stem.models.insert) builds STEM tables from a dense model's up-projections:
        its ``insert.from`` is a dense variant (no other FFN kind, no DSE memory); init ``calibrated`` reads a
        source of ``sources`` (null: the stage's first data source) and needs its settings (written null: none)."""
        if ins.init == InsertInit.CALIBRATED and ins.calibration is None and "calibration" in ins._written:
            raise FieldError("insert.calibration", "None; init 'calibrated' needs a calibration source: expected "
                             "{source: <a source of 'sources'>, tokens, unseen, sequential}")
        src = self.variant(ins.from_)
        fail(src is not None, "insert.from", f"{ins.from_!r} is not a variant of config/variants.yaml; expected a "
             "dense one")
        what = f"ffn {src.ffn!r}" if src.ffn != "dense" else "a DSE memory" if src.dse is not None else None
        fail(what is None, "insert.from", f"{ins.from_!r} has {what}; expected a dense variant (the insertion builds "
             "the STEM tables from its dense up-projections)")
        source = ins.settings.source
        fail(source is None or source in self.sources, "insert.calibration.source",
             f"{source!r} is not a source; expected one of {sorted(self.sources)} (or null: the stage's first data "
             "source)")

    def _check_cell(self, scale: Scale, m: MatrixEntry):
        """A matrix entry's scale has an arch and a tokenizer; each of its stages is defined, starts from an
        earlier one, fits the model's context; an inserted variant's source is in the matrix."""
        for what in ("archs", "tokenizer"):
            fail(scale in getattr(self, what), f"{what}.{scale}", f"missing (scale {scale} is in the matrix)")
        for v in m.seeds if isinstance(m.seeds, dict) else ():
            fail(v in m.variants, f"matrix.{scale}.seeds.{v}",
                 f"{v!r} is not one of matrix.{scale}.variants ({', '.join(m.variants)})")
        for stage in m.stages:
            spec = self.stages.get(stage, {}).get(scale)
            where = f"stages.{stage}.{scale}"
            fail(spec is not None, where, f"missing (listed in matrix.{scale}.stages)")
            init = spec.init_from
            fail(init is None or isinstance(init, HFInit) or (init in m.stages and m.stages.index(init) <
                                                              m.stages.index(stage)),
                 f"{where}.init_from", f"{spec.init_from_mapping!r} must be an earlier stage of matrix.{scale}.stages "
                 f"{list(map(str, m.stages))}")
            for v in m.variants:   # a mid-training insertion starts from a matrix variant's earlier stage
                vspec = self.variant(v)
                ins, v_init = vspec.insert, (vspec.stage or {}).get("init_from", init)
                fail(not (ins and ins.stage == stage and (not v_init or (not isinstance(v_init, (dict, HFInit))
                                                                         and ins.from_ not in m.variants))),
                     f"matrix.{scale}.variants", f"{v} is inserted into {ins and ins.from_!r} at {stage}; expected "
                     f"{ins and ins.from_!r} in the matrix and stages.{stage}.{scale}.init_from an earlier stage "
                     "(or {hf: ...})")
            max_len = spec.max_seq_len or self.archs[scale].max_seq_len
            fail(spec.seq_len <= max_len, f"{where}.seq_len", f"{spec.seq_len} exceeds the model's max_seq_len "
                 f"{max_len} (set max_seq_len and a rope_scaling for the stage)")


def baseline_variant(overrides: dict) -> str:
    """The variant every other is compared with: the one config/variants.yaml marks ``baseline: true`` (with
    ``overrides``, a config's variant_overrides)."""
    marked = [name for name, v in variants(overrides).items() if v.baseline]
    if len(marked) != 1:
        raise ConfigError(f"key 'baseline': expected exactly one variant with baseline: true in config/variants.yaml "
                          f"and variant_overrides (the report's baseline), found {', '.join(marked) or 'none'}")
    return marked[0]


# ---- reading a config ----------------------------------------------------------------------------------
def parse(cfg: dict, origin: str = "config") -> Experiment:
    """The typed tree of an experiment config mapping; one ``ConfigError`` line ``{origin}: key '...': ...``
    for the first problem. The config's plugin modules are imported first (they register the FFN kinds,
    suite kinds, analyses and generators the config may name)."""
    try:
        mods = convert(tuple[str, ...], cfg.get("plugins") or (), "plugins") if isinstance(cfg, dict) else ()
        try:
            plugins.load(mods, origin=f"{origin}: key 'plugins'")
        except ValueError as e:
            raise ConfigError(str(e).removeprefix(f"{origin}: ")) from None
        tree = node(Experiment, cfg)
    except ConfigError as e:
        raise ConfigError(f"{origin}: {e}") from None
    if tree.sweeps is not None:   # the DSE paper's Sec. 3 sweeps: every point builds (stem.sweeps)
        sweeps.validate(tree, origin)
    return tree


def load(path) -> Experiment:
    """The typed tree of a config file (``parse`` of its YAML, the file named in every error line)."""
    return parse(read_yaml(path), str(path))
