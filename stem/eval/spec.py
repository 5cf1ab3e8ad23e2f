"""Eval suites as the workflow sees them: the suite kinds, a suite's resolved spec, an eval job's spec, the
experiment's eval targets and an eval job's inputs (rules/eval.smk). Torch-free and lm-eval-free: the
Snakefile imports it to build the DAG.

Each suite ``kind`` is a ``SuiteKind`` registered in ``stem.registry.SUITE_KINDS``: its runner (a function, or a
``"module:function"`` string imported only when an eval job runs it), how a suite's spec is completed from the
experiment config, and the eval job's inputs besides the checkpoint. The built-in kinds (this module is their
plugin, stem.plugins):

    lm_eval   lm-eval tasks          stem.eval.harness:lm_eval_suite
    niah      needle-in-a-haystack   stem.eval.niah:run_niah
    ppl       rolling perplexity     stem.eval.ppl:run_ppl
    longppl   key-token perplexity   stem.eval.longppl:run_longppl

Another kind registers the same way from a plugin module, ``@suite_kind("name", resolve=..., inputs=...)``;
the config check, the workflow's inputs and ``stem.eval.run.evaluate`` all look it up there.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Callable

from stem import config as C
from stem import layout, plugins, seeds
from stem.config.experiment import POSITIVE, Experiment, at_least, fail, items
from stem.fields import expect
from stem.options import Truncation
from stem.registry import SUITE_KINDS, resolve as _import
from stem.specs import EvalSpec

# A suite's default ``truncation:`` (what a request longer than the model's context keeps; stem.eval.lm.truncate):
# the benchmark's published protocol where it has one, by task name (the task or ``{name}_...``: its subtasks and
# groups), else lm-eval's left truncation. LongBench's pred.py keeps the first and last halves of an over-long
# prompt. Needle-in-a-haystack prompts are built to fit their length (ours: stem.eval.niah refuses; RULER's, lm-eval's
# `ruler` group and its niah_* tasks) and are never cut: a cut could remove the needle. docs/evaluation.md
PROTOCOL_TRUNCATION = {"longbench": Truncation.MIDDLE, "ruler": Truncation.ERROR, "niah": Truncation.ERROR}


# ---- a suite's settings: the keys of ``eval.suites.<name>``, each kind's own (the config check, stem.config.experiment) ----
@dataclass(frozen=True, kw_only=True)
class SuiteSettings:
    """The keys every suite may set, whatever its kind. A kind's settings class adds its own keys (type, default,
    range as ``expect`` metadata, its own checks in ``__post_init__``); a key its class does not declare is
    refused at the config check (``Experiment._check_suites``). ``variants`` and ``metadata`` are checked
    against the rest of the config there too (they name variants)."""
    kind: str = "lm_eval"
    variants: typing.Any = None      # only these variants' checkpoints get the suite
    metadata: typing.Any = None      # lm-eval task metadata (e.g. {max_seq_lengths: [32768]})
    truncation: Truncation = None   # not set: the benchmark's protocol (default_truncation); null is refused
    SOURCES: typing.ClassVar[str] = ""     # the key that names the sources (for messages)

    def sources(self) -> list[str]:
        """The config's sources the suite reads (each must be defined)."""
        return []

    def check(self, exp: Experiment) -> None:
        """Checks against the rest of the config (a ``FieldError`` names the suite's key)."""


@dataclass(frozen=True, kw_only=True)
class OpenSuiteSettings(SuiteSettings):
    """A kind registered without a settings class: its own keys are handed on unchecked (``options``)."""
    EXTRA: typing.ClassVar[str] = "options"
    options: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class LmEvalSettings(SuiteSettings):
    """Kind ``lm_eval`` (stem.eval.harness): lm-eval tasks and how they are scored."""
    tasks: tuple[str, ...] = field(metadata=items(1, "tasks"))
    num_fewshot: int | None = field(default=None, metadata=at_least(0))
    metric: tuple[str, ...] = ()       # the reported metric per task, first found ("acc_norm,none", ...)
    gen_kwargs: typing.Any = None      # lm-eval's generation arguments (a string or a mapping)
    length_ranges: dict | None = None  # {table: [[lo, hi], ...]} by each sample's length field (LongBench)
    length_metric: str | None = None   # the metric the length ranges average (default score)
    task_metric: dict | None = None    # {task: metric} over ``metric``
    bootstrap_iters: int | None = field(default=None, metadata=at_least(0))


@dataclass(frozen=True, kw_only=True)
class NIAHSettings(SuiteSettings):
    """Kind ``niah`` (stem.eval.niah): needles at depths of a source's haystack, per length."""
    haystack: str
    lengths: tuple[int, ...] = field(metadata=items(1, "lengths"))
    depths: tuple[float, ...] = field(metadata=items(1, "depths"))
    samples: int = field(metadata=POSITIVE)
    needle: typing.Any = None          # original, or {text, question, answer_prefix, answer} (stem.eval.niah)
    max_gen_toks: int | None = field(default=None, metadata=POSITIVE)
    SOURCES: typing.ClassVar[str] = "haystack"

    def __post_init__(self):
        fail(self.truncation in (None, Truncation.ERROR), "truncation",
             f"'{self.truncation}'; expected error (NIAH prompts are built to fit their cells, never cut)")

    def sources(self) -> list[str]:
        return [self.haystack]


@dataclass(frozen=True, kw_only=True)
class PPLSettings(SuiteSettings):
    """Kind ``ppl`` (stem.eval.ppl): rolling perplexity over a source's documents."""
    source: str
    documents: int = field(default=100, metadata=POSITIVE)   # how many documents
    split: str | None = None           # val: only the documents the tokenize rules hold out (checked on resolve)
    SOURCES: typing.ClassVar[str] = "source"

    def sources(self) -> list[str]:
        return [self.source]


@dataclass(frozen=True, kw_only=True)
class LongPPLSettings(SuiteSettings):
    """Kind ``longppl`` (stem.eval.longppl): key-token perplexity, the longppl package's defaults; the evaluator
    defaults to the baseline variant (C.baseline_variant) at the same scale and stage."""
    categories: dict[str, str] = field(metadata=expect(
        lambda c: len(c) >= 1, "a mapping {column: source} (e.g. {book: long})"))
    documents: int = field(default=20, metadata=POSITIVE)
    short: int = field(default=4096, metadata=POSITIVE)
    window: int = field(default=1024, metadata=POSITIVE)
    length: int | None = field(default=None, metadata=at_least(2))
    alpha: float = 2.0                 # nats
    beta: float = -2.0                 # nats
    evaluator: str | None = None       # self or a variant
    SOURCES: typing.ClassVar[str] = "categories"

    def sources(self) -> list[str]:
        return list(self.categories.values())

    def check(self, exp: Experiment) -> None:
        fail(self.evaluator is None or self.evaluator in {*exp.variant_names(), "self"}, "evaluator",
             f"{self.evaluator!r}; expected self or a variant of config/variants.yaml")


@dataclass(frozen=True)
class SuiteKind:
    """How a kind of suite runs: ``runner(lm, spec, limit) -> (result fields, raw output, harness label)`` (a
    function or a ``"module:function"`` string); ``resolve(exp, spec)`` completes the suite's spec from the
    experiment config's typed tree (``stem.config.experiment.Experiment``; in place); ``inputs(exp, spec)`` are the files
    its eval job reads besides the checkpoint (rules/eval.smk); ``settings`` the class of its keys (a
    ``SuiteSettings``; the config check refuses any other key), ``OpenSuiteSettings`` where a kind states none."""
    runner: Callable[..., tuple[dict, dict, str]] | str
    resolve: Callable[[Experiment, dict], None] | None = None
    inputs: Callable[[Experiment, dict], dict] | None = None
    settings: type = OpenSuiteSettings

    def run(self, lm, spec: dict, limit=None) -> tuple[dict, dict, str]:
        """Run the suite (a string runner is imported now: torch and lm-eval only in the eval job)."""
        return _import(self.runner)(lm, spec, limit)


def suite_kind(name: str, resolve=None, inputs=None, settings=OpenSuiteSettings):
    """Decorator: register ``run`` as the runner of suite kind ``name`` (in ``stem.registry.SUITE_KINDS``), its keys
    the fields of ``settings`` (a ``SuiteSettings`` subclass)."""
    return SUITE_KINDS.register(name, lambda run: SuiteKind(run, resolve, inputs, settings))


def kind_of(spec: dict) -> SuiteKind:
    """The registered kind of a suite spec; a one-line error naming the known kinds otherwise."""
    if spec["kind"] not in SUITE_KINDS:
        raise ValueError(f"suite {spec.get('suite')!r}: unknown kind {spec['kind']!r} "
                         f"(expected one of {sorted(SUITE_KINDS)})")
    return SUITE_KINDS[spec["kind"]]


def suite_spec(exp: Experiment, suite: str) -> dict:
    """The resolved spec of one suite from an experiment config (its typed tree)."""
    ev = exp.eval or {}
    suites = ev.get("suites", {})
    if suite not in suites:
        raise ValueError(f"suite {suite!r}: not in the {exp.experiment} config (expected one of {sorted(suites)})")
    spec = {"kind": "lm_eval", "num_fewshot": None, "metric": [], "gen_kwargs": None, **suites[suite]}
    kind = kind_of({**spec, "suite": suite})
    spec.setdefault("truncation", default_truncation(spec))
    spec.update(suite=suite, batch_size=ev.get("batch_size", 32), seed=exp.seed, device=str(exp.device),
                fixtures=layout.fixtures_dir(exp.experiment) if ev.get("fixtures") else None)
    if kind.resolve:
        kind.resolve(exp, spec)
    return spec


def default_truncation(spec: dict) -> str:
    """The published protocol of the suite's benchmark (``PROTOCOL_TRUNCATION``) when all its tasks have the same
    one; ``error`` for NIAH (never cut); else ``left`` (lm-eval's)."""
    if spec["kind"] == "niah":
        return str(Truncation.ERROR)
    found = {next((p for name, p in PROTOCOL_TRUNCATION.items() if t == name or t.startswith(name + "_")), None)
             for t in spec.get("tasks") or []}
    return str(found.pop()) if len(found) == 1 and None not in found else str(Truncation.LEFT)


def job_spec(exp: Experiment, experiment, scale, variant, stage, suite) -> dict:
    """The spec of one eval job (the JSON of a stem.specs.EvalSpec, checked): the suite's spec and the
    checkpoint it must read (``job``)."""
    spec = {**suite_spec(exp, suite), "job": {"experiment": experiment, "scale": scale, "variant": variant,
                                              "stage": stage}, **plugins.spec_key(exp)}
    return EvalSpec.from_dict(spec).to_dict()


def suites_for(exp: Experiment, stage: str, variant: str | None = None) -> list[str]:
    """The suites of a stage's checkpoints; with ``variant``, those whose ``variants:`` (if any) name it."""
    ev = exp.eval or {}
    return [s for s in (ev.get("stages") or {}).get(stage, [])
            if variant is None or variant in ((ev.get("suites") or {}).get(s) or {}).get("variants", [variant])]


# ---- workflow helpers (rules/eval.smk) ------------------------------------------------------------------
def eval_targets(exp: Experiment) -> list[str]:
    """Every eval JSON of the experiment: each trained checkpoint x the suites of its stage (a suite with
    ``variants:`` only for those variants' checkpoints, their seeds included)."""
    return [layout.eval_json(exp.experiment, s, v, st, suite)
            for s, v, st in C.train_targets(exp) + C.seed_targets(exp)
            for suite in suites_for(exp, st, seeds.JobId.parse(s, v, st).variant)]


RULER_TASK_PREFIXES = ("niah_", "ruler_")   # lm-eval's RULER task names (stem.eval.ruler_data.TASKS)


def fixture_spec(exp: Experiment) -> dict:
    """The spec of the eval_fixtures job (stem.eval.fixtures.write_fixtures): the config's ``eval.fixtures``, the
    world, the seed and, for the RULER stand-in, the tokenizer of its ``scale`` (its items are sized in tokens)."""
    fx = exp.eval["fixtures"]
    spec = {**fx, "world": C.mapping(exp.world) if exp.world else {}, "seed": exp.seed}
    if fixture_inputs(exp):
        spec["ruler"] = {**fx["ruler"], **fixture_inputs(exp)}
    return spec


def fixture_inputs(exp: Experiment) -> dict:
    """The eval_fixtures job's inputs: the tokenizer that sizes the RULER stand-in, when a fixture task is RULER's."""
    fx = exp.eval["fixtures"]
    ruler = fx.get("ruler") and any(t.startswith(RULER_TASK_PREFIXES) for t in fx.get("tasks", []))
    return {"tokenizer": layout.tokenizer_path(exp.experiment, fx["ruler"]["scale"])} if ruler else {}


def rule_inputs(exp: Experiment, experiment, scale, variant, stage, suite) -> dict:
    spec = {**suite_spec(exp, suite), "job": {"experiment": experiment, "scale": scale, "variant": variant,
                                              "stage": stage}}
    inputs = {"checkpoint": layout.checkpoint(experiment, scale, variant, stage)}
    kind = kind_of(spec)
    return {**inputs, **kind.inputs(exp, spec)} if kind.inputs else inputs


# ---- the built-in kinds: how their specs resolve and what their jobs read --------------------------------
def _lm_eval_inputs(exp: Experiment, spec: dict) -> dict:
    return {"fixtures": spec["fixtures"]} if spec["fixtures"] else {}


def _source(spec: dict) -> str:
    return spec.get("haystack") or spec["source"]


def _resolve_documents(exp: Experiment, spec: dict) -> None:
    spec["documents"] = C.documents_spec(exp, _source(spec))


def _resolve_ppl(exp: Experiment, spec: dict) -> None:
    # `documents` (a count) is replaced by the reader spec
    spec["n_documents"] = spec.get("documents", _default(PPLSettings, "documents"))
    _resolve_documents(exp, spec)
    if spec.get("split") is not None:   # `split: val`: only the documents the tokenize rules hold out of training
        src = C.source_of(exp, spec["source"])
        if spec["split"] != "val" or src.doc_keys != "content" or not src.val_fraction:
            raise ValueError(f"eval suite {spec['suite']!r}: key 'split': {spec['split']!r}; expected val, of a source "
                             f"with doc_keys: content and a val_fraction (sources.{spec['source']}: "
                             f"{C.source_mapping(src)})")
        spec["held_out"] = {"fraction": src.val_fraction, "seed": exp.seed}


def _documents_inputs(exp: Experiment, spec: dict) -> dict:
    return {"documents": C.source_inputs(exp, _source(spec))}


SUITE_KINDS.add("lm_eval", SuiteKind("stem.eval.harness:lm_eval_suite", inputs=_lm_eval_inputs,
                                     settings=LmEvalSettings))
SUITE_KINDS.add("niah", SuiteKind("stem.eval.niah:run_niah", _resolve_documents, _documents_inputs, NIAHSettings))
SUITE_KINDS.add("ppl", SuiteKind("stem.eval.ppl:run_ppl", _resolve_ppl, _documents_inputs, PPLSettings))


def _default(settings: type, key: str):
    return next(f.default for f in dataclasses.fields(settings) if f.name == key)


# LongPPL (stem.eval.longppl): the defaults of LongPPLSettings (the longppl package's) and the evaluator the same
# scale and stage's baseline model (C.baseline_variant: the variant config/variants.yaml marks baseline: true)
LONGPPL_DEFAULTS = {k: _default(LongPPLSettings, k) for k in ("alpha", "beta", "short", "window", "documents")}


def _resolve_longppl(exp: Experiment, spec: dict) -> None:
    for k, v in {**LONGPPL_DEFAULTS, "evaluator": C.baseline_variant(exp)}.items():
        spec.setdefault(k, v)
    spec["category_documents"] = {cat: C.documents_spec(exp, src) for cat, src in spec["categories"].items()}


def _longppl_inputs(exp: Experiment, spec: dict) -> dict:
    job, ev = spec["job"], spec["evaluator"]
    inputs = {"documents": [p for src in spec["categories"].values() for p in C.source_inputs(exp, src)]}
    if ev not in ("self", job["variant"]):
        inputs["evaluator"] = layout.checkpoint(job["experiment"], job["scale"], ev, job["stage"])
    return inputs


SUITE_KINDS.add("longppl", SuiteKind("stem.eval.longppl:run_longppl", _resolve_longppl, _longppl_inputs,
                                     LongPPLSettings))
