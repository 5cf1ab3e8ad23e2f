"""Evaluate one checkpoint on one suite and write the normalised result.

Output ``results/{experiment}/{scale}/{variant}/{stage}/eval/{suite}.json`` (written atomically)::

    {"experiment", "scale", "variant", "stage", "suite", "checkpoint", "limit",
     "harness": "lm-eval 0.4.x" | "stem.eval.niah" | "stem.eval.ppl", "fixtures": dir or null,
     "num_fewshot", "gen_kwargs", "wall_seconds",
     "tasks":  {task: {"metric": "acc_norm,none", "value": 61.2, "stderr": 2.1, "n": 40,
                       "version": 1.0, "all_metrics": {"acc,none": 58.0, "acc_stderr,none": 2.2, ...}}},
     "groups": {group: same fields (n = sum over its tasks, version = group version or null)},
     "by_length": {...},   # longbench only, see by_length()
     "cells": [{"length", "depth", "accuracy", "n"}, ...]}  # niah only

All metric values and stderrs are in percent (0-100, as the paper prints them), except a ``ppl``
suite's perplexities (``"unit": "perplexity"``). The raw lm-eval output (per-sample records
included) is kept beside it as ``eval/raw/{suite}.json``.

Each suite ``kind`` (lm_eval, niah, ppl) is a runner registered with ``@suite_kind(name)`` in
``stem.registry.SUITE_KINDS`` (this module is its built-in plugin, stem.plugins; another kind registers the
same way from a plugin module); the config check, the workflow's inputs and ``evaluate`` all look it up there.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from stem import layout, plugins, provenance
from stem.registry import SUITE_KINDS  # the registry of suite kinds; the built-in runners below


@dataclass(frozen=True)
class SuiteKind:
    """How a kind of suite runs: ``run(lm, spec, limit) -> (result fields, raw output, harness label)``;
    ``resolve(cfg, spec)`` completes the suite's spec from the experiment config (in place); ``inputs(cfg,
    spec)`` are the files its eval job reads besides the checkpoint (rules/eval.smk)."""
    run: Callable[..., tuple[dict, dict, str]]
    resolve: Callable[[dict, dict], None] | None = None
    inputs: Callable[[dict, dict], dict] | None = None


def suite_kind(name: str, resolve=None, inputs=None):
    """Decorator: register ``run`` as the runner of suite kind ``name`` (in ``stem.registry.SUITE_KINDS``)."""
    return SUITE_KINDS.register(name, lambda run: SuiteKind(run, resolve, inputs))


def kind_of(spec: dict) -> SuiteKind:
    """The registered kind of a suite spec; a one-line error naming the known kinds otherwise."""
    if spec["kind"] not in SUITE_KINDS:
        raise ValueError(f"suite {spec.get('suite')!r}: unknown kind {spec['kind']!r} "
                         f"(expected one of {sorted(SUITE_KINDS)})")
    return SUITE_KINDS[spec["kind"]]


def suite_spec(cfg: dict, suite: str) -> dict:
    """The resolved spec of one suite from an experiment config (stem.config dict)."""
    ev = cfg.get("eval") or {}
    suites = ev.get("suites", {})
    if suite not in suites:
        raise ValueError(f"suite {suite!r}: not in the {cfg['experiment']} config (expected one of {sorted(suites)})")
    spec = {"kind": "lm_eval", "num_fewshot": None, "metric": [], "gen_kwargs": None, **suites[suite]}
    kind = kind_of({**spec, "suite": suite})
    spec.update(suite=suite, batch_size=ev.get("batch_size", 32), seed=cfg["seed"], device=cfg.get("device"),
                fixtures=layout.fixtures_dir(cfg["experiment"]) if ev.get("fixtures") else None)
    if kind.resolve:
        kind.resolve(cfg, spec)
    return spec


def job_spec(cfg: dict, experiment, scale, variant, stage, suite) -> dict:
    """The spec of one eval job (the JSON of a stem.specs.EvalSpec, checked): the suite's spec and the
    checkpoint it must read (``job``)."""
    from stem.specs import EvalSpec
    spec = {**suite_spec(cfg, suite), "job": {"experiment": experiment, "scale": scale, "variant": variant,
                                              "stage": stage}, **plugins.spec_key(cfg)}
    return EvalSpec.from_dict(spec).to_dict()


IDENTITY = layout.IDENTITY


def expected_job(spec: dict, out_json=None) -> dict | None:
    """What the checkpoint must be: the job spec's ``job``, else what an output path of the results layout
    ``.../results/{experiment}/{scale}/{variant}/{stage}/eval/{suite}.json`` says, else None."""
    if spec.get("job"):
        return spec["job"]
    return layout.eval_identity(out_json) if out_json else None


def _expected(spec: dict, checkpoint, out_json) -> dict | None:
    """``expected_job``, else what the checkpoint's own path names (``layout.checkpoint_identity``)."""
    if isinstance(checkpoint, (str, Path)):
        return expected_job(spec, out_json) or layout.checkpoint_identity(checkpoint)
    return expected_job(spec, out_json)


def check_job(checkpoint, saved: dict, expected: dict | None, out_json=None) -> None:
    """One-line error when the checkpoint's saved job spec is not the one this eval job is for."""
    if not expected:
        return
    wrong = [f"{k} {saved.get(k)!r} != {expected[k]!r}" for k in IDENTITY if saved.get(k) != expected[k]]
    if wrong:
        have, want = ("/".join(str(d.get(k)) for k in IDENTITY) for d in (saved, expected))
        job = f"this eval job (output {out_json})" if out_json else "this eval job"
        raise ValueError(f"checkpoint {Path(checkpoint) / 'config.json'}: saved job {have}, but {job} is for {want} "
                         f"({', '.join(wrong)})")


def suites_for(cfg: dict, stage: str) -> list[str]:
    return list(((cfg.get("eval") or {}).get("stages") or {}).get(stage, []))


# ---- workflow helpers (rules/eval.smk) ------------------------------------------------------------------
def eval_targets(cfg: dict) -> list[str]:
    """Every eval JSON of the experiment: each trained checkpoint x the suites of its stage."""
    from stem import config as C
    return [layout.eval_json(cfg["experiment"], s, v, st, suite)
            for s, v, st in C.train_targets(cfg) + C.seed_targets(cfg) for suite in suites_for(cfg, st)]


def rule_inputs(cfg: dict, experiment, scale, variant, stage, suite) -> dict:
    spec = suite_spec(cfg, suite)
    inputs = {"checkpoint": layout.checkpoint(experiment, scale, variant, stage)}
    kind = kind_of(spec)
    return {**inputs, **kind.inputs(cfg, spec)} if kind.inputs else inputs


# ---- lm-eval suites -----------------------------------------------------------------------------------
def task_manager(fixtures: str | None):
    from lm_eval.tasks import TaskManager
    if fixtures is None:
        return TaskManager()
    if not Path(fixtures, "manifest.json").is_file():
        raise ValueError(f"fixtures {fixtures}: not generated (run the eval_fixtures rule)")
    return TaskManager(include_path=str(Path(fixtures).resolve()), include_defaults=False)


def run_lm_eval(lm, spec: dict, limit=None) -> dict:
    from lm_eval import evaluator, simple_evaluate

    tm = task_manager(spec["fixtures"])
    unknown = [t for t in spec["tasks"] if not tm.match_tasks([t])]
    if unknown:
        where = f"fixtures {spec['fixtures']}" if spec["fixtures"] else "lm-eval"
        raise ValueError(f"suite {spec['suite']!r}: unknown task(s) {unknown} in {where}")
    # lm-eval's add_env_info runs torch's collect_env (pip, nvidia-smi and friends as subprocesses: ~2 s per eval
    # job, ~100 s of a tiny run); the eval JSON's `provenance` (stem.provenance) records the versions instead
    env_info, evaluator.add_env_info = evaluator.add_env_info, _no_env_info
    try:
        return simple_evaluate(model=lm, tasks=list(spec["tasks"]), num_fewshot=spec["num_fewshot"], limit=limit,
                               task_manager=tm, log_samples=True, gen_kwargs=spec["gen_kwargs"],
                               bootstrap_iters=spec.get("bootstrap_iters", 1000), random_seed=spec["seed"])
    finally:
        evaluator.add_env_info = env_info


def _no_env_info(results: dict):
    results["env_info"] = "not collected: see the eval JSON's provenance (stem.provenance)"


def _pick(metrics: dict, prefs: list[str]) -> str | None:
    names = [k for k, v in metrics.items() if "," in k and "_stderr" not in k and isinstance(v, (int, float))]
    for p in prefs:
        if p in names:
            return p
    return names[0] if names else None


def _entry(metrics: dict, prefs: list[str], n: int, version) -> dict:
    pct = {k: (100.0 * float(v) if isinstance(v, (int, float)) else None)
           for k, v in metrics.items() if "," in k and not isinstance(v, str)}
    name = _pick(metrics, prefs)
    stderr_key = name.replace(",", "_stderr,", 1) if name else None
    return {"metric": name, "value": pct.get(name), "stderr": pct.get(stderr_key), "n": n,
            "version": version, "all_metrics": pct}


def normalise(raw: dict, spec: dict) -> dict:
    """tasks/groups of a simple_evaluate result, one metric chosen per task (spec['metric'] preference)."""
    results, groups = raw["results"], raw.get("group_subtasks", {})
    n_samples = {t: v.get("effective", v.get("original")) for t, v in raw.get("n-samples", {}).items()}
    prefs = spec["metric"] if isinstance(spec["metric"], list) else [spec["metric"]]
    per_task = spec.get("task_metric", {})

    def leaves(g):
        return [x for s in groups.get(g, []) for x in (leaves(s) if s in groups else [s])]

    out = {"tasks": {}, "groups": {}}
    for name, metrics in results.items():
        p = [per_task[name]] + prefs if name in per_task else prefs
        if name in groups:
            out["groups"][name] = _entry(metrics, p, sum(n_samples.get(t, 0) for t in leaves(name)),
                                         raw.get("versions", {}).get(name))
        else:
            out["tasks"][name] = _entry(metrics, p, n_samples.get(name), raw.get("versions", {}).get(name))
    return out


def by_length(raw: dict, ranges: dict, metric: str = "score", field: str = "length") -> dict:
    """LongBench scores per context-length range, from each sample's ``doc[field]``.

    For every range table (e.g. table5, table6) and every group (and the whole suite, "all"), the
    value of a range is the mean over the group's tasks of the task's mean score on its samples in
    that range (tasks with no sample in the range are left out), in percent - as the paper's
    "averaged over tasks within each context-length range".
    """
    groups = raw.get("group_subtasks", {})
    samples = raw.get("samples", {})

    def leaves(g):
        return [x for s in groups.get(g, []) for x in (leaves(s) if s in groups else [s])]

    members = {g: leaves(g) for g in groups}
    members["all"] = sorted(samples)
    out = {"field": field, "metric": metric}
    for table, edges in ranges.items():
        rows = []
        for lo, hi in edges:
            label = f"{lo}-{hi}" if hi is not None else f"{lo}+"
            per_task = {}
            for task, recs in samples.items():
                vals = [float(r[metric]) for r in recs if lo <= r["doc"][field] and (hi is None or r["doc"][field] < hi)]
                if vals:
                    per_task[task] = (100.0 * sum(vals) / len(vals), len(vals))
            row = {"range": label, "lo": lo, "hi": hi, "tasks": {t: v for t, (v, _) in per_task.items()},
                   "n": {t: k for t, (_, k) in per_task.items()}, "groups": {}}
            for g, ts in members.items():
                vs = [per_task[t][0] for t in ts if t in per_task]
                row["groups"][g] = sum(vs) / len(vs) if vs else None
            rows.append(row)
        out[table] = rows
    return out


def _lm_eval_inputs(cfg: dict, spec: dict) -> dict:
    return {"fixtures": spec["fixtures"]} if spec["fixtures"] else {}


@suite_kind("lm_eval", inputs=_lm_eval_inputs)
def lm_eval_suite(lm, spec: dict, limit=None) -> tuple[dict, dict, str]:
    raw = run_lm_eval(lm, spec, limit)
    norm = normalise(raw, spec)
    if spec.get("length_ranges"):
        norm["by_length"] = by_length(raw, spec["length_ranges"], spec.get("length_metric", "score"))
    return norm, raw, f"lm-eval {raw.get('lm_eval_version') or _lm_eval_version()}"


# ---- our own harnesses ------------------------------------------------------------------------------
def _documents(spec: dict, n_chars: int | None = None, n_docs: int | None = None, tok=None) -> list[str]:
    """The first documents of the suite's source, up to n_chars characters or n_docs documents
    (a tokenized source, e.g. ProLong's MDS, is decoded with ``tok``)."""
    from stem.data.sources import iter_documents
    docs, total = [], 0
    for d in iter_documents(spec["documents"]):
        d = d if isinstance(d, str) else tok.decode(d.tolist())
        docs.append(d)
        total += len(d)
        if (n_chars and total >= n_chars) or (n_docs and len(docs) >= n_docs):
            break
    return docs


def _source(spec: dict) -> str:
    return spec.get("haystack") or spec["source"]


def _resolve_documents(cfg: dict, spec: dict) -> None:
    from stem import config as C
    spec["documents"] = C.documents_spec(cfg, _source(spec))


def _resolve_ppl(cfg: dict, spec: dict) -> None:
    spec["n_documents"] = spec.get("documents", 100)  # `documents` (a count) is replaced by the reader spec
    _resolve_documents(cfg, spec)


def _documents_inputs(cfg: dict, spec: dict) -> dict:
    from stem import config as C
    return {"documents": C.source_inputs(cfg, _source(spec))}


@suite_kind("niah", resolve=_resolve_documents, inputs=_documents_inputs)
def run_niah(lm, spec: dict, limit=None) -> tuple[dict, dict, str]:
    from stem.eval import niah
    too_long = [L for L in spec["lengths"] if L > lm.max_length]
    if too_long:
        raise ValueError(f"niah: lengths {too_long} exceed the checkpoint's context ({lm.max_length} tokens)")
    docs = _documents(spec, n_chars=8 * max(spec["lengths"]) * 4, tok=lm.tok)
    gen = spec.get("max_gen_toks", 12)
    items = niah.make_items(lm.tok, docs, spec["lengths"], spec["depths"], limit or spec["samples"], spec["seed"], gen)
    res = niah.run(lm, items, gen)
    out = {"tasks": {"niah": {"metric": "exact_match", "value": res["accuracy"], "stderr": None, "n": res["n"],
                              "version": "stem-niah-1", "all_metrics": {"exact_match": res["accuracy"]}}},
           "groups": {}, "cells": res["cells"]}
    return out, {"items": items, **res}, "stem.eval.niah"


@suite_kind("ppl", resolve=_resolve_ppl, inputs=_documents_inputs)
def run_ppl(lm, spec: dict, limit=None) -> tuple[dict, dict, str]:
    import math
    from lm_eval.api.instance import Instance

    docs = _documents(spec, n_docs=limit or spec["n_documents"], tok=lm.tok)
    reqs = [Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(docs)]
    lls = lm.loglikelihood_rolling(reqs)
    n_tok = sum(len(lm.tok_encode(d)) for d in docs)
    n_bytes = sum(len(d.encode()) for d in docs)
    ppl, bpb = math.exp(-sum(lls) / n_tok), -sum(lls) / n_bytes / math.log(2)
    entry = {"metric": "token_perplexity", "value": ppl, "stderr": None, "n": len(docs), "version": "stem-ppl-1",
             "unit": "perplexity", "all_metrics": {"token_perplexity": ppl, "bits_per_byte": bpb}}
    raw = {"loglikelihoods": lls, "tokens": n_tok, "bytes": n_bytes}
    return {"tasks": {"ppl": entry}, "groups": {}}, raw, "stem.eval.ppl"


# ---- one suite, end to end -------------------------------------------------------------------------------
def evaluate(checkpoint, spec, out_json=None, raw_json=None, limit=None, lm=None, device=None,
             model_args: dict | None = None) -> dict:
    """``model_args``: further StemLM arguments (e.g. offload=True, cache_rows=N)."""
    from stem.eval.lm import StemLM
    from stem.io import atomic_write_json
    from stem.specs import EvalSpec

    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise ValueError(f"limit {limit!r}: expected a positive whole number of items per task (or no limit)")
    spec = spec.to_dict() if isinstance(spec, EvalSpec) else spec
    kind = kind_of(spec)
    spec = EvalSpec.from_dict(spec).to_dict()   # checked once; the runners read its JSON mapping
    t0 = time.time()
    lm = lm or StemLM(str(checkpoint), device=device, batch_size=spec["batch_size"], **(model_args or {}))
    check_job(checkpoint, lm.spec, _expected(spec, checkpoint, out_json), out_json)
    norm, raw, harness = kind.run(lm, spec, limit)
    job = lm.spec
    result = {"experiment": job.get("experiment"), "scale": job.get("scale"), "variant": job.get("variant"),
              "stage": job.get("stage"), "suite": spec["suite"], "checkpoint": str(checkpoint), "limit": limit,
              "harness": harness, "fixtures": spec.get("fixtures"), "num_fewshot": spec.get("num_fewshot"),
              "gen_kwargs": spec.get("gen_kwargs"), **norm, "wall_seconds": round(time.time() - t0, 2)}
    result["provenance"] = provenance.record(spec, provenance.manifests_of(job), train_spec=job)
    if getattr(lm, "offload", None) is not None:  # STEM tables off the device: the engine's counters
        result["offload"] = lm.offload.stats()
    if raw_json:
        from lm_eval.utils import handle_non_serializable
        Path(raw_json).parent.mkdir(parents=True, exist_ok=True)
        from stem.io import atomic_write_text
        atomic_write_text(raw_json, json.dumps(raw, default=handle_non_serializable, indent=1))
    if out_json:
        atomic_write_json(out_json, result)
    return result


def _lm_eval_version() -> str:
    from importlib.metadata import version
    return version("lm_eval")
