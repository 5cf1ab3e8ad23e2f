"""``python -m stem bench host``: the host side of a host-table step (``train.tables: host``, ``stem.train.tables``,
``stem.optim.adamw``) measured on this CPU, for the step-time model (``stem.train.comms.host_update``).

One table of ``--rows`` x ``--width`` fp32 (default the 1B vocabulary, 128,256 rows, at width 1,024 so that it,
its two AdamW moments and the replays' copies fit a 24 GB machine beside other work) in host memory, trained by
the real code for ``--steps`` steps of ``--accum`` micro-batches of ``--micro-tokens`` token ids drawn from a
Zipf(1) law (``stem.train.comms.zipf_seen``'s; config/rehearsal.yaml's 1b/stem/pretrain as fitted: 4 x 8,192).
Per micro-batch: the fetch (``_fetch``: unique ids, a lazy table's missed steps replayed for them, the rows
gathered) and the gradient's accumulation (``HostLookup.backward``'s ``StepRows.accumulate``: on a GPU the device's
work, here this CPU's); per step gradient clipping (``stem.train.distributed.clip_grad_norm_``: the rows' norm, on a
GPU the device's; its scale is the update's), the optimizer (``RowSparseAdamW.step``: the touched rows' AdamW update,
each row scaled by clipping's coefficient as it is gathered) and the zeroing;
at the end ``settle`` (a save: every row brought current), so that
the replays are counted in full, amortised over the steps. Both updates: ``lazy`` (dense AdamW made lazy and
exact, ``table_update: dense``) and ``sparse`` (row-sparse AdamW). Beside them the CPU's memory bandwidth,
measured the same way (``c = a + b`` on 512 MB arrays, 3 x 4 B an element), to turn seconds into bytes of
traffic per parameter: the factors the model extrapolates by a node's bandwidth. Each update runs with clipping's
scale in the update's gather (``HostTable.scale_grad``, the code's) and, for comparison in the same run, as session
14's code scaled (the held rows in place, a pass of their own in the clip phase), timed in this thread's CPU seconds
(the bandwidth too); the overlap's comparison in wall seconds.
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

from stem.io import atomic_write_json
from stem.optim import adamw
from stem.optim.adamw import RowSparseAdamW
from stem.train import distributed
from stem.train.comms import zipf_seen
from stem.train.tables import _fetch, to_host

PHASES = ("fetch", "device", "accumulate", "clip", "update", "zero", "settle")
CLIP = 1.0   # the clipping norm (config/paper.yaml's optim.grad_clip): the rows are scaled whether or not it binds


class _Holder(nn.Module):
    def __init__(self, rows: int, width: int):
        super().__init__()
        self.table = nn.Embedding(rows, width)
        nn.init.normal_(self.table.weight, std=0.02)


def bandwidth_gbs(n: int = 1 << 27, repeats: int = 5) -> float:
    """This CPU's memory bandwidth at the current thread count: ``c = a + b`` on ``n`` fp32 elements (3 x 4 B
    an element), best of ``repeats`` in this thread's CPU seconds (as the synchronous runs); GB/s."""
    a, b, c = torch.rand(n), torch.rand(n), torch.empty(n)
    best = float("inf")
    for _ in range(repeats):
        t = time.thread_time()
        torch.add(a, b, out=c)
        best = min(best, time.thread_time() - t)
    return 12 * n / best / 1e9


def _draws(args, g) -> list[list[torch.Tensor]]:
    p = zipf_seen(1, args.rows).float()   # the probability of each id (one draw)
    return [[torch.multinomial(p, args.micro_tokens, replacement=True, generator=g) for _ in range(args.accum)]
            for _ in range(args.steps)]


def _clock(times: dict, phase: str, t0: float, now=time.perf_counter) -> float:
    t = now()
    times[phase] += t - t0
    return t


def _table(args, update: str, workers: int | None):
    """(module, weight, optimizer) of one host table under ``update`` (lazy | sparse), its update on ``workers``
    threads if given (``RowSparseAdamW.overlap``)."""
    torch.manual_seed(0)
    holder = _Holder(args.rows, args.width)
    to_host(holder, ("table",), sparse=("table",) if update == "sparse" else ())
    m, w = holder.table, holder.table.weight
    opt = RowSparseAdamW([{"params": [w], "lr": 1e-3, "lr_mult": 1.0, "weight_decay": 0.1}], betas=(0.9, 0.95),
                         eps=1e-8)
    opt.track(m)
    if workers:
        opt.overlap(workers)
    return m, w, opt


def _micro(m, w, ids, times: dict, device_s: float, now) -> int:
    """One micro-batch: its rows fetched (waiting for their own pending update, if any), the device's forward and
    backward as a timed wait of ``device_s``, the rows' gradient accumulated (``HostLookup.backward``'s
    ``StepRows.accumulate``); returns the rows fetched."""
    t = now()
    _, host_ids, _ = _fetch(m, ids)
    t = _clock(times, "fetch", t, now)
    time.sleep(device_s)
    t = _clock(times, "device", t, now)
    grad = torch.randn(host_ids.numel(), w.shape[1])   # the unique rows' summed gradient, back from the device
    t = now()
    m.step_rows().accumulate(w, host_ids, grad)
    _clock(times, "accumulate", t, now)
    return host_ids.numel()


def run(args, update: str, steps: list, workers: int | None = None, device_s: float = 0.0, cpu: bool = False,
        inplace: bool = False) -> dict:
    """``steps`` (per step, its micro-batches' ids) on one host table under ``update`` (lazy | sparse), the update on
    ``workers`` threads if given, each step's device work a wait of ``device_s`` (over its micro-batches); clipping's
    scale in the update's gather (``inplace``: the rows scaled in place by clipping, as session 14's code did); timed
    in this thread's CPU seconds (``cpu``: a synchronous run on a loaded machine, where wall seconds count the other
    processes' turns) or wall seconds."""
    return _run(args, update, steps, workers, device_s, time.thread_time if cpu else time.perf_counter, inplace) | {
        "fused": adamw.FUSED_ROWS, "clock": "thread CPU" if cpu else "wall",
        "scale": "in place" if inplace else "in the update's gather"}


def _scale_in_place(m, coef):
    """Session 14's clipping of a host table's held rows: scaled in place, a pass of their own."""
    rows = m.held_grad()[1]
    rows.mul_(coef.to(rows.device))


def _run(args, update: str, steps: list, workers: int | None, device_s: float, now, inplace: bool = False) -> dict:
    m, w, opt = _table(args, update, workers)
    if inplace:
        m.scale_grad = lambda coef: _scale_in_place(m, coef)
    ctx, replays = distributed.DistContext(), []
    if update == "lazy":   # counted as they run (LazyRows.replay returns the row-steps it replayed)
        lazy = opt.lazy[w]
        replay = lazy.replay
        lazy.replay = lambda *a: replays.append(replay(*a)) or replays[-1]
    times, touched, fetched = dict.fromkeys(PHASES, 0.0), 0, 0
    for i, micro in enumerate(steps):
        if i == 1:   # step 0 (the moments allocated) is not timed
            times, touched, fetched, replays[:] = dict.fromkeys(PHASES, 0.0), 0, 0, []
        fetched += sum(_micro(m, w, ids, times, device_s / len(micro), now) for ids in micro)
        touched += w.grad._nnz()   # unique rows: the step's accumulation holds each id once
        t = now()
        distributed.clip_grad_norm_(m, CLIP, ctx)
        t = _clock(times, "clip", t, now)
        opt.step()
        t = _clock(times, "update", t, now)
        opt.zero_grad(set_to_none=True)
        _clock(times, "zero", t, now)
    t = now()
    opt.settle()
    _clock(times, "settle", t, now)
    n = len(steps) - 1
    replayed = sum(replays)   # missed row-steps of the timed steps and step 0's, every one replayed by the end
    return {"update": update, "steps": n, "rows": args.rows, "width": args.width, "workers": workers,
            "device_s": device_s, "touched_rows_per_step": touched / n, "fetched_rows_per_step": fetched / n,
            "replayed_row_steps_per_step": replayed / n, "seconds_per_step": {k: v / n for k, v in times.items()},
            "host_s_per_step": sum(v for k, v in times.items() if k != "device") / n,
            "total_s_per_step": sum(times.values()) / n}


def factors(r: dict, gbs: float) -> dict:
    """Bytes of memory traffic per parameter at this CPU's bandwidth ``gbs`` of a row-sparse run's phases: fetch
    and accumulation per fetched parameter (a micro-batch's unique rows), clipping (norm and scale), and update and
    zeroing, per touched one (the step's unique rows)."""
    s, d = r["seconds_per_step"], r["width"]
    per_touched, per_fetched = (gbs * 1e9 / (r[k] * d) for k in ("touched_rows_per_step", "fetched_rows_per_step"))
    return {"fetch_b": s["fetch"] * per_fetched, "accumulate_b": s["accumulate"] * per_fetched,
            "fetch_accumulate_b": (s["fetch"] + s["accumulate"]) * per_fetched,
            "clip_b": s["clip"] * per_touched, "update_b": (s["update"] + s["zero"]) * per_touched}


def bytes_per_param(runs: dict, gbs: float) -> dict:
    """``factors`` of the row-sparse run and the lazy run's replay: its extra host seconds over the row-sparse
    run's (the replays are its only extra work) per replayed parameter-step."""
    sp, lz = runs["sparse"], runs["lazy"]
    extra = lz["host_s_per_step"] - sp["host_s_per_step"]
    return {**factors(sp, gbs), "replay_b": extra * gbs * 1e9 / (lz["replayed_row_steps_per_step"] * lz["width"])}


def main(args):
    torch.set_num_threads(args.threads or 1)
    g = torch.Generator().manual_seed(1)
    args.rows, args.width = args.table_rows, args.table_width
    args.steps, args.accum, args.micro_tokens = args.host_steps, args.accum, args.host_micro_tokens
    steps = _draws(args, g)
    gbs = bandwidth_gbs()
    before = {u: run(args, u, steps, cpu=True, inplace=True) for u in ("sparse", "lazy")}
    runs = {u: run(args, u, steps, cpu=True) for u in ("sparse", "lazy")}
    device_s = runs["sparse"]["host_s_per_step"] if args.device_s is None else args.device_s
    overlap = [(run(args, u, steps, None, device_s), run(args, u, steps, args.workers, device_s)) for u in runs]
    out = {"threads": torch.get_num_threads(), "bandwidth_gbs": gbs, "runs": runs, "before_runs": before,
           "bytes_per_param": bytes_per_param(runs, gbs), "before_bytes_per_param": bytes_per_param(before, gbs),
           "overlap": overlap}
    _print(out, args)
    _print_overlap(overlap, args)
    if args.json:
        atomic_write_json(args.json, out)
    return out


def _print(out: dict, args):
    print(f"Host side of a host-table step on this CPU ({out['threads']} thread(s); memory bandwidth "
          f"{out['bandwidth_gbs']:.1f} GB/s, c = a + b): one {args.rows:,} x {args.width:,} fp32 table, "
          f"{args.steps} steps of {args.accum} x {args.micro_tokens:,} Zipf(1) ids, then a save (settle). Seconds per "
          "step; seconds per 1e9 parameters of what each phase touches.")
    print("| update | clipping's scale | touched rows / step | replayed row-steps / step | fetch | device | accumulate | clip | "
          "update | zero | settle (per step) | total s / step | host s per 1e9 touched params |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in list(out["before_runs"].values()) + list(out["runs"].values()):
        s = r["seconds_per_step"]
        per = r["host_s_per_step"] / (r["touched_rows_per_step"] * r["width"]) * 1e9
        print(f"| {r['update']} | scaled {r['scale']} | {r['touched_rows_per_step']:,.0f} | "
              f"{r['replayed_row_steps_per_step']:,.0f} | " + " | ".join(f"{s[k]:.4f}" for k in PHASES)
              + f" | {r['total_s_per_step']:.4f} | {per:.2f} |")
    for key, route in (("before_bytes_per_param", "scaled in place"), ("bytes_per_param", "scaled in the update's gather")):
        b = out[key]
        print(f"Traffic factors, {route} (s x {out['bandwidth_gbs']:.1f} GB/s / parameters): fetch {b['fetch_b']:.1f} + "
              f"accumulate {b['accumulate_b']:.1f} = {b['fetch_accumulate_b']:.1f} B a fetched parameter, clip {b['clip_b']:.1f} and update + zero "
              f"{b['update_b']:.1f} B a touched parameter, lazy replay {b['replay_b']:.1f} B a replayed parameter-step")
    print("(stem.train.comms.HOST_BYTES_PER_PARAM states the second: accumulate and clip are the device's on a GPU)")


def _print_overlap(pairs: list, args):
    print(f"\nThe update off the critical path (RowSparseAdamW.overlap, {args.workers} worker(s)): each step's device "
          "work a timed wait (default: the synchronous row-sparse step's host seconds), wall seconds a step.")
    print("| update | device wait s | synchronous step s | overlapped step s | overlapped / synchronous |")
    print("|---|---|---|---|---|")
    for sync, over in pairs:
        print(f"| {sync['update']} | {sync['device_s']:.3f} | {sync['total_s_per_step']:.3f} | "
              f"{over['total_s_per_step']:.3f} | {over['total_s_per_step'] / sync['total_s_per_step']:.2f} |")
