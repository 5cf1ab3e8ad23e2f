"""The lm-eval adapter: run a suite's lm-eval tasks on a ``StemLM`` and normalise lm-eval's output to the eval
JSON's ``tasks``/``groups`` (one metric per task, in percent), plus LongBench's scores per context-length range.
The runner of suite kind ``lm_eval`` (registered by name in stem.eval.spec); imported only by eval jobs."""
from __future__ import annotations

import functools
import tempfile
from importlib import metadata
from pathlib import Path

from lm_eval import evaluator, simple_evaluate
from lm_eval import utils as lm_eval_utils
from lm_eval.tasks import TaskManager


def task_manager(fixtures: str | None, meta: dict | None = None):
    """lm-eval's tasks (the fixtures' offline ones when given); ``meta`` reaches the tasks that generate their
    own data (RULER: ``max_seq_lengths``, ``tokenizer``)."""
    if fixtures is None:
        return TaskManager(metadata=meta)
    if not Path(fixtures, "manifest.json").is_file():
        raise ValueError(f"fixtures {fixtures}: not generated (run the eval_fixtures rule)")
    return TaskManager(include_path=str(Path(fixtures).resolve()), include_defaults=False, metadata=meta)


def run_lm_eval(lm, spec: dict, limit=None) -> dict:
    """``spec["metadata"]`` (a suite's ``metadata:``) goes to the tasks; RULER's generators size their items with
    the tokenizer it names, by default the checkpoint's own (written as a transformers folder for the job)."""
    with tempfile.TemporaryDirectory() as tmp:
        meta = spec.get("metadata")
        if meta is not None and "tokenizer" not in meta:
            # here, not at the top: transformers (seconds of CPU), which no other suite needs
            from stem.hf.tokenizer import save_tokenizer
            save_tokenizer(Path(lm.pretrained) / "tokenizer.json", lm.tok.eos_token, lm.max_length, tmp)
            meta = {**meta, "tokenizer": tmp}
        return _run_lm_eval(lm, spec, limit, task_manager(spec["fixtures"], meta))


def _run_lm_eval(lm, spec: dict, limit, tm) -> dict:
    unknown = [t for t in spec["tasks"] if not tm.match_tasks([t])]
    if unknown:
        where = f"fixtures {spec['fixtures']}" if spec["fixtures"] else "lm-eval"
        raise ValueError(f"suite {spec['suite']!r}: unknown task(s) {unknown} in {where}")
    # lm-eval's add_env_info runs torch's collect_env (pip, nvidia-smi and friends as subprocesses: ~2 s per eval
    # job, ~100 s of a tiny run); the eval JSON's `provenance` (stem.provenance) records the versions instead
    env_info, evaluator.add_env_info = evaluator.add_env_info, _no_env_info
    # lm-eval's apply_template compiles its Jinja template anew for every document and field (~1,500 compiles for
    # the 8 commonsense tasks: about a third of a tiny eval job's CPU); the same template compiled once renders
    # the same text
    apply_template, lm_eval_utils.apply_template = lm_eval_utils.apply_template, _apply_template
    try:
        return simple_evaluate(model=lm, tasks=list(spec["tasks"]), num_fewshot=spec["num_fewshot"], limit=limit,
                               task_manager=tm, log_samples=True, gen_kwargs=spec["gen_kwargs"],
                               bootstrap_iters=spec.get("bootstrap_iters", 1000), random_seed=spec["seed"])
    finally:
        evaluator.add_env_info = env_info
        lm_eval_utils.apply_template = apply_template


@functools.lru_cache(maxsize=4096)
def _compiled_template(template: str):
    return lm_eval_utils.env.from_string(template)


def _apply_template(template: str, doc: dict) -> str:
    """lm_eval.utils.apply_template with each template compiled once (the same Environment, the same output)."""
    return _compiled_template(template).render(**doc)


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


def lm_eval_suite(lm, spec: dict, limit=None) -> tuple[dict, dict, str]:
    """The runner of suite kind ``lm_eval``."""
    raw = run_lm_eval(lm, spec, limit)
    norm = normalise(raw, spec)
    if spec.get("length_ranges"):
        norm["by_length"] = by_length(raw, spec["length_ranges"], spec.get("length_metric", "score"))
    return norm, raw, f"lm-eval {raw.get('lm_eval_version') or metadata.version('lm_eval')}"
