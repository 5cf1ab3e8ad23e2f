"""``python -m stem bench comms``: the table layouts measured side by side on the CPU (gloo; labelled as such, not
a GPU figure). For each world size (2 and 4 forked ranks, ``stem.train.comms.fork_ranks``) and table width
(tiny: V 96 x d_ff 24; 350M-width: V 32,000 x d_ff 2,560, one STEM layer of a reduced 3-layer backbone), a
model with its tables as FSDP units and one with row-sharded tables train the same batches, their steps
interleaved repeat by repeat: the bytes one step puts through the process group (counted on rank 0,
``count_collectives``: the payload of every collective) and the step's wall time (rank 0, between barriers),
each as the ratio rows / FSDP units, with the spread (min-max) of the per-repeat time ratios. Host tables
(one process: no collectives) against resident tables, step time only, interleaved likewise. Then the owner
load of row-sharded tables (``stem.train.comms.owner_imbalance``: the busiest owner's rows over the mean
owner's) measured on the token shards of the tiny experiment's corpora, where built (``data/tiny/*/tokens``),
for contiguous blocks of ids and the interleaved map, beside the Zipf(1) estimate at the paper's vocabulary.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from stem import config as C
from stem.io import atomic_write_json
from stem.models.model import build_model
from stem.train import comms, distributed, step
from stem.data.shards import ShardSet
from stem.train.plan import ParallelPlan
from stem.train.tables import row_shardable, to_host

WIDTHS = {"tiny": {"vocab_size": 96, "d_ff": 24}, "350m-width": {"vocab_size": 32000, "d_ff": 2560}}
SEQ, MICRO = 64, 2
BALANCE = [(8, 4096), (32, 4096), (8, 16384)]   # (world, tokens a micro-batch) of the owner-load measurement
PAPER_VOCAB = 128256


def _spec(width: str, tables: str, world: int):
    """The tiny config's 350m/stem/pretrain job, reshaped (a tool input: the YAML's mapping changed, then parsed;
    its batches are random ids, so no tokenizer sizes the vocabulary)."""
    path = C.REPO / "config" / "tiny.yaml"
    cfg = C.read_yaml(path)
    cfg["archs"]["350m"].update(d_model=64, n_layers=3, n_heads=2, n_kv_heads=1, max_seq_len=SEQ, **WIDTHS[width])
    cfg["stages"]["pretrain"]["350m"].update(batch_size=2 * MICRO * world, micro_batch=MICRO, seq_len=SEQ)
    cfg["tokenizer"]["350m"] = {"kind": "pretrained", "path": "none (random ids)"}
    cfg["cluster"] = {"tables": tables}
    return C.train_job(C.experiment.parse(cfg, f"{path} (reshaped by stem.bench.comms)"), "350m", "stem", "pretrain")


def _setup(spec, ctx):
    torch.manual_seed(0)
    model = build_model(spec.model, ctx.device)
    plan = ParallelPlan.of(spec.train, ctx.world, tables=row_shardable(model))
    to_host(model, plan.host_tables, plan.sparse_rows)
    distributed.parallelize(model, ctx, plan)
    return model, step.make_optimizer(model, spec, plan, fused=False), plan


def _timed_step(run, batches, ctx) -> float:
    model, opt, _ = run
    if ctx.world > 1:
        dist.barrier()
    t = time.perf_counter()
    step.train_step(model, opt, batches, ctx, nullcontext(), 1e-4, 1.0)
    if ctx.world > 1:
        dist.barrier()
    return time.perf_counter() - t


def _compare(layouts, width: str, ctx, repeats: int) -> dict:
    """Two layouts of the same model, steps interleaved: per-layout times and (multi-rank) counted bytes."""
    runs = [_setup(_spec(width, t, ctx.world), ctx) for t in layouts]
    g = torch.Generator().manual_seed(1)
    v = WIDTHS[width]["vocab_size"]
    batches = [(x, x, None) for x in (torch.randint(0, v, (MICRO, SEQ), generator=g) for _ in range(runs[0][2].accum))]
    sent = []
    for run in runs:   # the first step (optimizer state, allocator) is not timed; its collectives are counted
        with comms.count_collectives() as seen:
            _timed_step(run, batches, ctx)
        sent.append(sum(n * k for (_, n), k in seen.items()))
    times = [[], []]
    for _ in range(repeats):
        for i, run in enumerate(runs):
            times[i].append(_timed_step(run, batches, ctx))
    ratios = [b / a for a, b in zip(*times)]
    return {"world": ctx.world, "width": width, "layouts": list(layouts), "bytes": sent,
            "step_s": [statistics.median(t) for t in times], "time_ratio": statistics.median(ratios),
            "time_ratio_range": [min(ratios), max(ratios)], "bytes_ratio": sent[1] / sent[0] if sent[0] else None}


def _ranks(out: str, repeats: int):
    ctx = distributed.setup(torch.device("cpu"))
    rows = [_compare(("fsdp", "rows"), w, ctx, repeats) for w in WIDTHS]
    if ctx.is_main:
        Path(out).write_text(json.dumps(rows))
    distributed.teardown(ctx)


def main(args):
    torch.set_num_threads(args.threads or 1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in (2, 4):
            out = Path(tmp) / f"w{world}.json"
            codes = comms.fork_ranks(_ranks, world, str(out), args.repeats)
            if codes != [0] * world:
                raise RuntimeError(f"bench comms: world {world}: ranks exited with {codes}")
            rows += json.loads(out.read_text())
    rows += [_compare(("fsdp", "host"), w, distributed.DistContext(), args.repeats) for w in WIDTHS]
    print(f"Table layouts on the CPU (gloo; {args.repeats} interleaved repeats, median; ratio = second / first "
          "layout, spread = min-max of the per-repeat ratios). Bytes: payload of every collective of one step, "
          "counted on rank 0 (none in one process).")
    print("| world | tables | layouts | bytes per step | bytes ratio | step s | step time ratio [spread] |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        b = " / ".join(f"{x / 1e6:.3g} MB" for x in r["bytes"])
        br = "-" if r["bytes_ratio"] is None else f"{r['bytes_ratio']:.4f}"
        lo, hi = r["time_ratio_range"]
        print(f"| {r['world']} | {r['width']} | {' vs '.join(r['layouts'])} | {b} | {br} | "
              f"{' / '.join(f'{s:.3g}' for s in r['step_s'])} | {r['time_ratio']:.2f} [{lo:.2f}, {hi:.2f}] |")
    balance = owner_balance()
    print("\nOwner load of row-sharded tables: the busiest owner's rows a step over the mean owner's (1 = balanced), "
          "contiguous id blocks vs interleaved ids (stem.train.tables).")
    print("| tokens | vocabulary | world | tokens a micro-batch | steps | blocks | interleaved |")
    print("|---|---|---|---|---|---|---|")
    for b in balance:
        print(f"| {b['tokens']} | {b['vocab']:,} | {b['world']} | {b['micro_tokens']:,} | {b['steps']} | "
              f"{b['blocks']:.2f} | {b['interleaved']:.2f} |")
    if args.json:
        atomic_write_json(Path(args.json), {"layouts": rows, "owner_load": balance})
    return rows


def owner_balance() -> list[dict]:
    """``owner_imbalance`` on the tiny corpora's training tokens (where built) at ``BALANCE``, and the Zipf(1)
    estimate (``comms.zipf_seen``: expected unique ids owned, busiest over mean) at the paper's vocabulary."""
    out = []
    for manifest in sorted((C.REPO / "data" / "tiny").glob("*/tokens/*/manifest.json")):
        shards = ShardSet(manifest.parent)
        tokens = shards.get(0, len(shards))
        for world, micro in (b for b in BALANCE if b[0] * b[1] <= len(tokens)):   # a whole step at least
            out.append({"tokens": f"{manifest.parent.relative_to(C.REPO)} (measured)", "vocab": shards.vocab_size,
                        "world": world, "micro_tokens": micro,
                        **comms.owner_imbalance(tokens, shards.vocab_size, world, micro)})
    for world, micro in ((8, 16384), (32, 16384)):
        seen = comms.zipf_seen(micro, PAPER_VOCAB)
        mean = float(seen.sum()) / world
        out.append({"tokens": "Zipf(1) (estimate)", "vocab": PAPER_VOCAB, "world": world, "micro_tokens": micro,
                    "steps": "-", "blocks": float(seen[:-(-PAPER_VOCAB // world)].sum()) / mean,
                    "interleaved": float(seen[::world].sum()) / mean})
    return out
