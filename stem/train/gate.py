"""The workflow's pre-flight gate (rules/train.smk's onstart): every GPU training job of the DAG traced at its
world size (``stem.train.memtrace``, cached) against ``cluster.gpu_mem_gib``, a refused job named with the layout
that would fit it (the closed form, ``stem.train.memory``, picks the candidates worth tracing). Imported on every
workflow run, so torch loads only when there is a GPU job to trace."""
from __future__ import annotations

from stem import config as C
from stem.config.experiment import Experiment
from stem.options import Device
from stem.train.memory import FIT_MARGIN, estimate, option
from stem.train.plan import job_layout


# ----------------------------------------------------------------------------- jobs of an experiment

def gpu_jobs(exp: Experiment, only=None) -> list[tuple[str, str, str]]:
    """The training jobs that run on GPUs (only those have GPU memory to check): ``only`` (a set of (scale,
    variant, stage), e.g. a DAG's, sweep points included), else the experiment's matrix."""
    if exp.device == Device.CPU:
        return []
    jobs = sorted(only) if only is not None else C.train_targets(exp)
    return [j for j in jobs if job_layout(exp, j[0])[1] > 0]


def check(exp: Experiment, cache_dir, workers: int = 1, only=None) -> list[str]:
    """One line per GPU training job (of ``only``, a set of (scale, variant, stage), if given) whose traced
    peak exceeds ``cluster.gpu_mem_gib``; none if that is unset."""
    cluster = exp.cluster
    limit, jobs = cluster.gpu_mem_gib, gpu_jobs(exp, only)
    if limit is None or not jobs:
        return []
    # torch-level, imported only when there is something to trace: the workflow's onstart imports this module
    # on every run (the tiny DAG has no GPU job)
    from stem.models.model import build_model
    from stem.train import memtrace
    strategy = cluster.parallel
    opts = [memtrace.options(C.train_spec(exp, *j), job_layout(exp, j[0])[0], strategy) for j in jobs]
    traces = memtrace.traced([(spec, run) for spec, (_, run), _ in opts], cache_dir, workers)
    out = []
    for (scale, variant, stage), (spec, (plan, run), cands), r in zip(jobs, opts, traces):
        if r["peak_gib"] <= limit:
            continue
        # the first later layout whose trace fits, traced one at a time for a job that does not fit, and only
        # where the closed form leaves it a chance
        model = build_model(spec.model, "meta")
        rest = [p for p in (cands[cands.index(run) + 1:] if run in cands else cands)
                if estimate(model, p)["total_gib"] <= limit * FIT_MARGIN]
        fits = next(((p, t) for p in rest for t in memtrace.traced([(spec, p)], cache_dir, workers) if t["peak_gib"] <= limit), None)
        advice = (f"it fits with {option(plan, fits[0], scale, stage)} ({fits[1]['peak_gib']:.1f} GiB traced)" if fits else
                  f"no smaller micro-batch, activation checkpointing or host tables fit it: give it more GPUs "
                  f"(cluster.train.{scale})")
        out.append(f"training job {scale}/{variant}/{stage}: traced peak {r['peak_gib']:.1f} GiB per GPU exceeds "
                   f"cluster.gpu_mem_gib = {limit} GiB (world {r['world']}, micro-batch {r['micro_batch']} x "
                   f"{r['seq_len']}{', act. ckpt' if r['activation_checkpointing'] else ''}"
                   f"{', host tables' if run.host_tables else ''}); {advice}")
    return out
