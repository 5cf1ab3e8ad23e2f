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

from dataclasses import dataclass
from typing import Callable

from stem import config as C
from stem import layout, plugins, seeds
from stem.experiment import Experiment
from stem.options import Truncation
from stem.registry import SUITE_KINDS, resolve as _import
from stem.specs import EvalSpec

# A suite's default ``truncation:`` (what a request longer than the model's context keeps; stem.eval.lm.truncate):
# the benchmark's published protocol where it has one, by task name (the task or ``{name}_...``: its subtasks and
# groups), else lm-eval's left truncation. LongBench's pred.py keeps the first and last halves of an over-long
# prompt. Needle-in-a-haystack prompts are built to fit their length (ours: stem.eval.niah refuses; RULER's, lm-eval's
# `ruler` group and its niah_* tasks) and are never cut: a cut could remove the needle. docs/evaluation.md
PROTOCOL_TRUNCATION = {"longbench": Truncation.MIDDLE, "ruler": Truncation.ERROR, "niah": Truncation.ERROR}


@dataclass(frozen=True)
class SuiteKind:
    """How a kind of suite runs: ``runner(lm, spec, limit) -> (result fields, raw output, harness label)`` (a
    function or a ``"module:function"`` string); ``resolve(exp, spec)`` completes the suite's spec from the
    experiment config's typed tree (``stem.experiment.Experiment``; in place); ``inputs(exp, spec)`` are the files
    its eval job reads besides the checkpoint (rules/eval.smk)."""
    runner: Callable[..., tuple[dict, dict, str]] | str
    resolve: Callable[[Experiment, dict], None] | None = None
    inputs: Callable[[Experiment, dict], dict] | None = None

    def run(self, lm, spec: dict, limit=None) -> tuple[dict, dict, str]:
        """Run the suite (a string runner is imported now: torch and lm-eval only in the eval job)."""
        return _import(self.runner)(lm, spec, limit)


def suite_kind(name: str, resolve=None, inputs=None):
    """Decorator: register ``run`` as the runner of suite kind ``name`` (in ``stem.registry.SUITE_KINDS``)."""
    return SUITE_KINDS.register(name, lambda run: SuiteKind(run, resolve, inputs))


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
            for suite in suites_for(exp, st, seeds.split(v)[0])]


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
    spec["n_documents"] = spec.get("documents", 100)  # `documents` (a count) is replaced by the reader spec
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


SUITE_KINDS.add("lm_eval", SuiteKind("stem.eval.harness:lm_eval_suite", inputs=_lm_eval_inputs))
SUITE_KINDS.add("niah", SuiteKind("stem.eval.niah:run_niah", _resolve_documents, _documents_inputs))
SUITE_KINDS.add("ppl", SuiteKind("stem.eval.ppl:run_ppl", _resolve_ppl, _documents_inputs))


# LongPPL (stem.eval.longppl): `categories` {column: source}; the defaults are the longppl package's (alpha 2,
# beta -2, short 4096, window 1024) and the evaluator the same scale and stage's baseline model
# (C.baseline_variant: the variant config/variants.yaml marks baseline: true)
LONGPPL_DEFAULTS = {"alpha": 2.0, "beta": -2.0, "short": 4096, "window": 1024, "documents": 20}


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


SUITE_KINDS.add("longppl", SuiteKind("stem.eval.longppl:run_longppl", _resolve_longppl, _longppl_inputs))
