"""Typed job specs: what one training or evaluation job is told, beside the model's ``ModelConfig``.

The workflow resolves each job's spec from the experiment config (``stem.config.train_spec``,
``stem.eval.spec.job_spec``) and passes it to the job as JSON (a rule parameter, so Snakemake reruns exactly
the jobs whose spec changed). The job builds the dataclass with ``from_dict`` once, which checks every key
(one line naming the key and what is expected), and reads typed fields from then on. ``to_dict`` gives the
JSON back in the same shape: a training job saves it with its checkpoint (``checkpoint/config.json``).

Keys added after the first specs were written (``OPTIONAL``: ``parallel``, ``schedule_steps``,
``tables``, ``activation_checkpointing``, ``peak_tflops``, ``wandb``, ``compile``, ``fit_gib``, ``host_workers``,
``host_mem_gbs``, ``host_core_gbs``, ``optim.table_update``) are written only when they differ from their default, so adding one leaves the
JSON of the jobs that do not use it unchanged.

The experiment config's nodes extend these classes where a job reads the same keys (``StageSchedule``,
``StageOptions``, ``RunSettings``, ``Layout``), so a key is declared once; the variants of config/variants.yaml
(with an experiment's variant_overrides) are ``Variant`` nodes, parsed here (``variants``) below the sweeps that
emit them.
"""
from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Annotated

from stem.fields import OPTIONAL, FieldError, Parser, check as _check, expect, key_of, node
from stem import io
from stem.io import ConfigError, deep_merge
from stem.layout import REPO
from stem.models.spec import DSEConfig, ModelConfig
from stem.optim import OptimSpec  # the train spec's optim section (torch-free; its build() imports torch lazily)
from stem.options import InsertInit, Schedule, Strategy, TableLayout, Truncation, values
from stem.registry import FFN_KINDS, REPORT_TABLES, SUITE_KINDS   # names only: entries load on use

STRATEGIES = values(Strategy)             # the backbone's parallel strategy (stem.train.distributed)
TABLE_LAYOUTS = values(TableLayout)       # where a multi-rank job keeps its lookup tables (stem.train.tables)


class SpecError(ValueError):
    """A job spec that does not hold what the job needs: one line naming the key."""


# ---- building a dataclass from JSON, checking each key against its type (stem.fields) -------------------
SPEC = Parser(SpecError, wrong="key '{key}': expected {expected}, got {value}",
              unknown="key '{key}': unknown (expected one of {names})", own=(ModelConfig,))
NAMES = Annotated[tuple[str, ...], expect(len, "a non-empty list of strings")]


def _plain(obj):
    """JSON-ready form of a spec: nested dataclasses as mappings, optional fields at their default left out."""
    if isinstance(obj, ModelConfig):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if not (f.metadata.get("omit_default") and getattr(obj, f.name) == f.default)}
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    return obj


class _Spec:
    """from_dict / to_dict for a job spec dataclass."""

    @classmethod
    def from_dict(cls, d: dict):
        """Build and check a spec; SpecError ``{kind} spec: key 'a.b': expected ..., got ...`` otherwise."""
        try:
            return node(cls, d, "", SPEC)
        except SpecError as e:
            raise SpecError(f"{cls.KIND} spec: {e}") from None

    @classmethod
    def coerce(cls, spec):
        """A spec given either as this dataclass or as its JSON mapping."""
        return spec if isinstance(spec, cls) else cls.from_dict(spec)

    def to_dict(self) -> dict:
        """The JSON mapping (lists for tuples: what a JSON round trip gives)."""
        return json.loads(json.dumps(_plain(self)))


# ---- training -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DataSource:
    weight: float
    manifest: str            # the source's token manifest (layout.tokens_manifest)

    def __post_init__(self):
        _check(self.weight > 0, "weight", "a number > 0", self.weight)


IN_01 = expect(lambda v: 0 <= v <= 1, "a number in [0, 1]")


@dataclass(frozen=True, kw_only=True)
class StageSchedule:
    """A stage's schedule and batch layout: declared once, here; the config's node of a stage
    (``stem.config.experiment.StageSettings``, ``stages.<stage>.<scale>``) and a training job's ``train`` section
    (``TrainSettings``) are both this class, so a key has one type and one range from the YAML to the loop."""
    lr: float = field(metadata=expect(lambda v: v > 0, "a number > 0"))
    schedule: Schedule
    warmup: float = field(metadata=IN_01)
    min_lr_ratio: float = field(metadata=IN_01)
    batch_size: int = field(metadata=expect(lambda v: v >= 1, "an integer >= 1"))   # global, in sequences
    # per-GPU sequences per forward (an upper bound under data parallelism)
    micro_batch: int = field(metadata=expect(lambda v: v >= 1, "an integer >= 1"))
    seq_len: int = field(metadata=expect(lambda v: v >= 2, "an integer >= 2"))
    steps: int = field(metadata=expect(lambda v: v >= 0, "an integer >= 0 (0: a stage that only imports)"))


AT_LEAST_1 = expect(lambda v: v >= 1, "an integer >= 1")


@dataclass(frozen=True, kw_only=True)
class RunSettings:
    """Logging, evaluation and checkpoint intervals and the run's reporting: declared once, here; the experiment
    config's ``train`` section (``stem.config.experiment.Train`` is this class) and the job spec's ``train`` section
    (``TrainSettings``) are both this class. ``peak_tflops``, ``wandb``, ``compile``: left out of a job's spec at
    their default."""
    log_interval: int = field(default=10, metadata=AT_LEAST_1)
    eval_interval: int = field(default=100, metadata=AT_LEAST_1)
    eval_batches: int = field(default=4, metadata=AT_LEAST_1)
    checkpoint_interval: int = field(default=100, metadata=AT_LEAST_1)
    tensorboard: bool = False   # also log metrics.jsonl's scalars to {stage dir}/tensorboard
    # the GPU's bf16 peak for MFU (stem.train.throughput)
    peak_tflops: float | None = field(default=None, metadata={**OPTIONAL, **expect(lambda v: v > 0, "a number > 0")})
    # a Weights & Biases project (rank 0 logs there)
    wandb: str | None = field(default=None, metadata={**OPTIONAL, **expect(lambda v: bool(v.strip()), "a project name")})
    compile: bool = field(default=False, metadata=OPTIONAL)   # torch.compile each block (stem.train.compile)

    def settings(self) -> dict:
        """What a job's TrainSettings takes from the config's ``train``: every key but those not set."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(RunSettings)
                if getattr(self, f.name) is not None}


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """A stage's options beside its schedule: declared once, here; the config's node of a stage
    (``stem.config.experiment.StageSettings``) and a training job's ``train`` section (``TrainSettings``) are both
    this class. ``schedule_steps``, ``activation_checkpointing``: left out of a job's spec at their default."""
    cross_doc_mask: bool = False    # attention within each packed document only (flex attention on CUDA)
    # true: a fresh AdamW; false: init_from's optimizer state (saved in that checkpoint's optimizer/)
    reset_optimizer: bool = True
    # the horizon the decay is laid over (default: steps)
    schedule_steps: int | None = field(default=None, metadata={**OPTIONAL, **AT_LEAST_1})
    activation_checkpointing: bool = field(default=False, metadata=OPTIONAL)


POSITIVE_NUMBER = expect(lambda v: v > 0, "a number > 0")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A training job's parallel layout and host tables: declared once, here; the experiment config's ``cluster``
    (``stem.config.experiment.Cluster`` extends it and writes ``parallel`` as ``strategy``) and a training job's
    ``train`` section (``TrainSettings``) are both this class; left out of a job's spec at their defaults."""
    parallel: Strategy = field(default=Strategy.FSDP, metadata=OPTIONAL)   # the backbone's strategy under torchrun
    tables: TableLayout = field(default=TableLayout.FSDP, metadata=OPTIONAL)  # lookup tables: fsdp units | rows | host
    # host tables' row update: null in the step (synchronous), or on this many worker threads while the device
    # computes the next step (stem.optim.adamw.RowSparseAdamW.overlap)
    host_workers: int | None = field(default=None, metadata={**OPTIONAL, **AT_LEAST_1})
    # host tables' host side (stem.train.comms.host_update): a node's host memory bandwidth, and one core's (GB/s;
    # a job's is the first, at most its cores x the second: stem.train.comms.host_bandwidth)
    host_mem_gbs: float = field(default=100.0, metadata={**OPTIONAL, **POSITIVE_NUMBER})
    host_core_gbs: float = field(default=10.0, metadata={**OPTIONAL, **POSITIVE_NUMBER})


@dataclass(frozen=True, kw_only=True)
class TrainSettings(Layout, StageOptions, RunSettings, StageSchedule):
    """The ``train`` section: one stage's schedule and batch layout (``StageSchedule``) and options
    (``StageOptions``), logging and checkpoints (``RunSettings``), the cluster's layout (``Layout``); each key
    declared once, in its class."""
    save_optimizer: bool = False    # true: a later stage carries this one's optimizer state
    # per-GPU GiB the plan fits the layout to (stem.train.memory.fit): cluster.gpu_mem_gib where cluster.fit_memory
    fit_gib: float | None = field(default=None, metadata={**OPTIONAL, **POSITIVE_NUMBER})

    def __post_init__(self):
        _check(self.parallel in STRATEGIES, "parallel", f"one of {', '.join(STRATEGIES)}", self.parallel)
        _check(self.tables in TABLE_LAYOUTS, "tables", f"one of {', '.join(TABLE_LAYOUTS)}", self.tables)

    def lr_schedule(self) -> dict:
        """Keyword arguments of stem.train.schedule.get_lr."""
        return {"lr": self.lr, "steps": self.steps, "warmup": self.warmup, "schedule": self.schedule,
                "min_lr_ratio": self.min_lr_ratio, "schedule_steps": self.schedule_steps}

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class TrainSpec(_Spec):
    """One training job: (experiment, scale, variant, stage), its model, optimizer, schedule, data and places."""
    KIND: typing.ClassVar[str] = "train"
    experiment: str
    scale: str
    variant: str
    stage: str
    seed: int
    device: str              # auto, cpu or cuda
    model: ModelConfig
    optim: OptimSpec
    train: TrainSettings
    data: dict[str, DataSource]
    tokenizer: str           # tokenizer.json (copied into the checkpoint)
    init_from: str | None    # the previous stage's checkpoint folder
    init_stage: str | None   # ... and that stage's name
    out_dir: str             # the stage folder (stem.layout.stage_dir)
    # mid-training insertion (stem.models.insert): {"from": the dense variant init_from belongs to, "init":
    # projected | raw | xavier | calibrated, and for calibrated "calibration": {source, manifest, tokens, unseen,
    # sequential} (stem.train.calibration)}; only in the insertion stage's spec
    insert: dict | None = field(default=None, metadata=OPTIONAL)
    plugins: NAMES = field(default=(), metadata=OPTIONAL)   # the config's plugin modules (stem.plugins)

    def __post_init__(self):
        ins = self.insert
        _check(ins is None or (set(ins) == {"from", "init"} | ({"calibration"} if ins.get("init") == "calibrated"
                                                                 else set())
                               and ins["init"] in values(InsertInit)
                               and (ins["init"] != "calibrated" or isinstance(ins["calibration"], dict))),
               "insert", f"null or {{from: <variant>, init: {' | '.join(values(InsertInit))}}} (calibrated: and "
               f"calibration: {{source, manifest, tokens, unseen, sequential}})", ins)
        _check(self.device in ("auto", "cpu", "cuda"), "device", "one of auto, cpu, cuda", self.device)
        _check(len(self.data) > 0, "data", "at least one source", self.data)

    @property
    def name(self) -> str:
        return f"{self.scale}/{self.variant}/{self.stage}"


# ---- variants (config/variants.yaml + an experiment's variant_overrides) -------------------------------------
# Parsed once per version of the file and set of overrides (``variants``): the experiment parse
# (stem.config.experiment) checks them, the sweeps and the knowledge sweep (stem.sweeps, stem.knowledge) emit their
# points as ``Variant``s, and every job, report and tool reads the node. Adding a key is one field line.
VARIANT_FILE = "config/variants.yaml + variant_overrides"


@dataclass(frozen=True)
class TrainCalibration:
    """A trained insertion's ``insert.calibration`` (init ``calibrated``; stem.train.calibration): ``tokens`` of
    ``source``'s train split (null: the insertion stage's first data source), the unseen rule, sequential or not.
    The job's ``insert.calibration`` (``Insert.spec``) has every field but ``from_step0``; an ``OPTIONAL`` one only
    where it differs from its default."""
    source: str | None = None
    tokens: int = field(default=16384, metadata=AT_LEAST_1)
    unseen: str = field(default="mean", metadata=expect(lambda v: v in ("mean", "raw"), "mean or raw"))
    sequential: bool = False
    # unseen and sequential: the best calibrated row of the step-0 analysis at these layers
    from_step0: bool = field(default=False, metadata=OPTIONAL)


@dataclass(frozen=True)
class Insert:
    """A variant's ``insert``: a mid-training insertion (stem.models.insert) starting at ``stage`` from the
    ``from`` variant's checkpoint of the stage before, with init ``init`` (``calibrated``: ``calibration``)."""
    from_: str = field(metadata={"key": "from"})   # the dense variant it starts from
    stage: str
    init: InsertInit = InsertInit.PROJECTED
    calibration: TrainCalibration | None = None   # init calibrated only (absent: the defaults)

    def __post_init__(self):
        if self.init != InsertInit.CALIBRATED and self.calibration is not None:
            raise FieldError("calibration", f"set, but insert.init is {str(self.init)!r}; expected it only with init "
                             "'calibrated'")

    @property
    def settings(self) -> TrainCalibration:
        """Init calibrated's settings (the defaults where ``calibration`` is not written)."""
        return self.calibration or TrainCalibration()


@dataclass(frozen=True)
class Variant:
    """A named variant (config/variants.yaml with variant_overrides) or a generated one (a sweep or knowledge
    point): its FFN kind and placement, DSE memory, insertion, optimizer and stage overrides (mappings set over the
    config's nodes, ``stem.fields.override``), presentation; the keys it does not type are ModelConfig keys
    (``model``: n_experts, moe_*, ...), handed to the model as written."""
    EXTRA: typing.ClassVar[str] = "model"
    ffn: str = "dense"   # a registered FFN kind (stem.registry.FFN_KINDS)
    # {every: k, offset: o} | {start: s} | a list of layers | {positions: [f, ...]} (stem.models.spec.resolve_placement)
    placement: dict | tuple[int, ...] | None = None
    # the sibling paper's hashed N-gram memory: {placement, and stem.models.spec.DSEConfig's keys}
    dse: dict | None = None
    insert: Insert | None = None
    optim: dict | None = None      # set over the config's optim (stem.optim.OptimSpec's keys)
    stage: dict | None = None      # set over the stage's settings (a point's: its data, steps, eval_batches)
    seed_index: int = field(default=0, metadata=expect(lambda k: k >= 0, "an integer >= 0"))   # a knowledge point's
    label: str | None = None          # the paper's row label (tables, legends)
    figure_label: str | None = None   # the figures' legend label where they say more
    color: str | None = None          # the figures' colour
    baseline: bool = False            # the one variant every other is compared with
    figures: tuple[str, ...] = ()     # the report figures that draw it
    model: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.ffn not in FFN_KINDS:
            raise FieldError("ffn", f"{self.ffn!r} is not a registered FFN kind; expected one of "
                             f"{', '.join(FFN_KINDS)}")
        if self.dse is not None:
            _check_dse(self.dse)
        if self.insert is not None and self.ffn != "stem":
            raise FieldError("ffn", f"{self.ffn!r}; an insertion builds ffn kind 'stem'")

    def model_spec(self) -> dict:
        """What stem.models.spec.model_config reads of it: FFN kind, placement, DSE memory, the model keys."""
        return {"ffn": self.ffn, "placement": self.placement, "dse": self.dse, **self.model}

    def mapping(self) -> dict:
        """The variant as a mapping (the keys it sets; the sweeps' arithmetic and cache key, stem.sweeps)."""
        return {**_set_keys(self), **self.model}


def _set_keys(obj) -> dict:
    """A node's fields that differ from their defaults, by the keys a mapping writes (nested nodes likewise)."""
    return {key_of(f): _set_keys(v) if dataclasses.is_dataclass(v) else v for f in dataclasses.fields(obj)
            if f.name != getattr(obj, "EXTRA", None) and (v := getattr(obj, f.name)) != f.default}


def _check_dse(dse):
    """A variant's ``dse``: placement plus DSEConfig's keys, checked by DSEConfig's own checks."""
    if not isinstance(dse, dict):
        raise FieldError("dse", f"{dse!r}; expected a mapping (placement, orders, heads, ...)")
    given = {k: tuple(v) if k == "orders" and isinstance(v, list) else v for k, v in dse.items() if k != "placement"}
    known = [f for f in DSEConfig.__dataclass_fields__ if f != "layers"]
    unknown = sorted(set(given) - set(known))
    if unknown:
        raise FieldError(f"dse.{unknown[0]}", f"unknown; expected placement or one of {', '.join(known)}")
    try:
        DSEConfig(**given)
    except (TypeError, ValueError) as e:
        raise FieldError(str(e).split("=")[0], str(e)) from None


VARIANT = Parser(ConfigError, wrong="key '{key}': {value}; expected {expected}",
                 unknown="key '{key}': unknown; expected one of {names}")


def variants(overrides: dict) -> dict[str, Variant]:
    """{name: Variant} of config/variants.yaml with ``overrides`` (an experiment's variant_overrides) merged over
    each, in the file's order; the first bad one is one ConfigError line ``variant 'x' (config/variants.yaml +
    variant_overrides): key '...': ...``. Parsed once per version of the file and of the overrides (shared nodes:
    frozen; the mapping is a copy)."""
    path = io.VARIANTS   # the file io.variants_file reads (a test may point it elsewhere)
    return dict(_variants(str(path), path.stat().st_mtime_ns, json.dumps(overrides or {}, sort_keys=True)))


@lru_cache(maxsize=8)
def _variants(path: str, mtime_ns: int, overrides: str) -> tuple:
    over = json.loads(overrides)
    return tuple((name, variant_node(name, deep_merge(spec, over.get(name) or {})))
                 for name, spec in io.variants_file().items())


def variant_node(name: str, spec: dict, parser: Parser = VARIANT) -> Variant:
    """One variant from its mapping; ``parser``'s one line ``variant 'name' (...): key ...`` otherwise."""
    try:
        return node(Variant, spec, "", parser)
    except parser.error as e:
        raise parser.error(f"variant {name!r} ({VARIANT_FILE}): {e}") from None


# ---- evaluation -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class JobId:
    experiment: str
    scale: str
    variant: str
    stage: str


@dataclass(frozen=True)
class EvalSpec(_Spec):
    """One eval job: a suite of a registered kind (stem.registry.SUITE_KINDS) run on one checkpoint. The common
    keys are typed; a kind's own keys (tasks, metric, lengths, documents, ...) and the config's ``plugins`` stay
    in ``options``, and ``to_dict`` puts them back beside the common ones (the flat mapping a runner reads)."""
    KIND: typing.ClassVar[str] = "eval"
    suite: str
    kind: str
    batch_size: int
    seed: int
    device: str | None = None
    fixtures: str | None = None      # offline fixture folder (tiny), else lm-eval's own data
    job: JobId | None = None         # the checkpoint this job must read (checked against its config.json)
    truncation: str = Truncation.LEFT   # requests longer than the context (stem.eval.lm.truncate; suite default)
    options: dict = field(default_factory=dict)

    COMMON: typing.ClassVar[tuple] = ("suite", "kind", "batch_size", "seed", "device", "fixtures", "job", "truncation")

    def __post_init__(self):
        _check(self.kind in SUITE_KINDS, "kind", f"a registered suite kind ({', '.join(sorted(SUITE_KINDS))})",
               self.kind)
        _check(self.truncation in values(Truncation), "truncation", " | ".join(values(Truncation)), self.truncation)
        _check(self.batch_size >= 1, "batch_size", "an integer >= 1", self.batch_size)

    @classmethod
    def from_dict(cls, d: dict):
        if not isinstance(d, dict):
            raise SpecError(f"eval spec: expected a mapping, got {d!r}")
        common = {k: v for k, v in d.items() if k in cls.COMMON}
        return super().from_dict({**common, "options": {k: v for k, v in d.items() if k not in cls.COMMON}})

    def to_dict(self) -> dict:
        d = super().to_dict()
        if d["job"] is None:
            del d["job"]
        return {**{k: v for k, v in d.items() if k != "options"}, **d["options"]}


# ---- aggregate (report) ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spikes:
    """Figure 5a's loss-spike rule: loss > median of the previous ``window`` logged steps + k x 1.4826 x MAD."""
    window: int = 50
    k: float = 6.0

    def __post_init__(self):
        _check(self.window >= 2, "window", "an integer >= 2", self.window)
        _check(self.k > 0, "k", "a number > 0", self.k)


TOLERANCES = ("accuracy", "params", "gflops", "roi", "other")
PROCEDURES = ("holm", "bh", "none")   # stem.report.verdict.adjust: the directions' multiple-comparison procedure


@dataclass(frozen=True)
class DirectionControl:
    """The direction verdicts' error control over the family of one report's directions (stem.report.verdict.
    control): ``procedure`` holm (family-wise error, Holm's step-down), bh (false discovery rate, Benjamini-
    Hochberg) or none (each cell's own 95% interval), at level ``alpha``."""
    procedure: str = "holm"
    alpha: float = 0.05

    def __post_init__(self):
        _check(self.procedure in PROCEDURES, "procedure", f"one of {', '.join(PROCEDURES)}", self.procedure)
        _check(isinstance(self.alpha, (int, float)) and not isinstance(self.alpha, bool) and 0 < self.alpha < 1,
               "alpha", "a number in (0, 1)", self.alpha)


@dataclass(frozen=True)
class ReportSpec(_Spec):
    """The aggregate stage's settings: the experiment config's ``report:`` section over the defaults.

    stages: {table: training stages feeding it, first with results wins} (default: each registered table's
    own ``stages``); tolerance: the diff's absolute tolerance per kind of cell; spikes: Figure 5a's rule;
    accepted: the accepted-disagreements file (YAML, relative to the repository; stem.report.diff.load_accepted)
    the directions gate honours and the report lists; directions: the direction verdicts' multiple-comparison
    control (``DirectionControl``: procedure, alpha).
    ``from_config`` checks it once; every report job reads this, never the raw section."""
    KIND: typing.ClassVar[str] = "report"
    experiment: str
    stages: dict[str, NAMES]
    tolerance: dict[str, float]
    spikes: Spikes = field(default_factory=Spikes)
    accepted: str | None = None
    directions: DirectionControl = field(default_factory=DirectionControl)

    def __post_init__(self):
        tables = REPORT_TABLES
        fed = [n for n, t in tables.items() if t.stages]
        for name, stages in self.stages.items():
            _check(name in fed, f"stages.{name}", f"a table fed by training stages ({', '.join(fed)})", name)
            for st in stages:
                _check(st in ("pretrain", "midtrain", "extend"), f"stages.{name}", "stages among pretrain, "
                       "midtrain, extend", list(stages))
        for name, tol in self.tolerance.items():
            _check(name in TOLERANCES and tol >= 0, f"tolerance.{name}",
                   f"a number >= 0 for one of {', '.join(TOLERANCES)}", tol)
        if self.accepted is not None:
            _check(isinstance(self.accepted, str) and (REPO / self.accepted).is_file(), "accepted",
                   "the path of an accepted-disagreements YAML file (relative to the repository)", self.accepted)

    @classmethod
    def from_config(cls, experiment: str, report: dict | None) -> "ReportSpec":
        """The defaults (registry stages, tolerances, spike rule) under experiment ``experiment``'s ``report:``
        section (stem.config.experiment.Experiment.report: untyped, checked here)."""
        rep = report or {}
        if not isinstance(rep, dict):
            raise SpecError(f"report spec: key 'report': expected a mapping, got {rep!r}")
        stages = {n: list(t.stages) for n, t in REPORT_TABLES.items() if t.stages}
        tolerance = {"accuracy": 1.0, "params": 0.01, "gflops": 0.01, "roi": 0.02, "other": 0.0}
        for key in ("stages", "tolerance", "directions"):
            if not isinstance(rep.get(key) or {}, dict):
                raise SpecError(f"report spec: key 'report.{key}': expected a mapping, got {rep[key]!r}")
        try:
            return cls.from_dict({"experiment": experiment, "stages": {**stages, **(rep.get("stages") or {})},
                                  "tolerance": {**tolerance, **(rep.get("tolerance") or {})},
                                  "spikes": {**dataclasses.asdict(Spikes()), **(rep.get("spikes") or {})},
                                  "accepted": rep.get("accepted"),
                                  "directions": {**dataclasses.asdict(DirectionControl()),
                                                 **(rep.get("directions") or {})}})
        except SpecError as e:   # name the config's key
            raise SpecError(str(e).replace("report spec: key '", "config: key 'report.", 1)) from None
