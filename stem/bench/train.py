"""Benchmarks that print figures (ratios measured in one run), never asserted by tests.

``python -m stem bench ffn``: forward+backward time of one STEM FFN layer vs one dense SwiGLU layer at
a scale's real shapes (default 350M: d 960, d_ff 2560, V 32000), STEM's table gradient dense and
sparse, and the FLOP ratio the accounting predicts (2 d d_ff vs 3 d d_ff per token).

``python -m stem bench train``: the whole training step (forward + backward + clipping + AdamW) of a model
at a scale's shapes with fewer layers (default 3, STEM in layer 2 as the 1/3 placement puts it): dense vs
STEM with the paper's dense table update vs STEM with ``optim.table_update: sparse``, timed interleaved, beside
the accounting's training-FLOP ratio; and the ratio projected to the paper's tokens per optimizer step.
"""
from __future__ import annotations

import math
import statistics
import time

import numpy as np
import torch

from stem import config as C
from stem.data.loader import positions_from_docs
from stem.config.experiment import baseline_variant, load
from stem.models.accounting import accounting
from stem.models.spec import model_config
from stem.models.ffn import build_ffn
from stem.models.model import build_model, document_ids
from stem.models.rope import rope_cos_sin
from stem.optim import build_optimizer, configure_table_update
from stem.train import distributed


def _median_seconds(fn, repeats: int, device=None) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs, after two warm-up runs."""
    def once():
        fn()
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):
        once()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _time_fwd_bwd(ffn, x, ids, repeats: int, device) -> float:
    def step():
        ffn.zero_grad(set_to_none=True)
        ffn(x, ids).sum().backward()
    return _median_seconds(step, repeats, device)


def bench_ffn(scale: str = "350m", tokens: int = 2048, repeats: int = 5, device: str = "cpu") -> list[dict]:
    cfg = C.model_config_for(load(C.REPO / "config" / "paper.yaml"), scale, C.baseline_variant())
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    x = torch.randn(1, tokens, cfg.d_model, device=dev, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=dev)
    rows = []
    for kind, sparse in [("dense", False), ("stem", False), ("stem", True)]:
        with torch.device(dev):
            ffn = build_ffn(kind, cfg, 0).to(dtype)
        if sparse:  # nn.Embedding's sparse backward alone (training's row-sparse path: `bench train`)
            ffn.table.sparse = True
        rows.append({"ffn": kind, "table_grad": ("sparse" if sparse else "dense") if kind == "stem" else "-",
                     "seconds": _time_fwd_bwd(ffn, x, ids, repeats, dev)})
    base = rows[0]["seconds"]
    for r in rows:
        r["ratio_vs_dense"] = r["seconds"] / base
    return rows


def main(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = bench_ffn(args.scale, args.tokens, args.repeats, args.device)
    arch = load(C.REPO / "config" / "paper.yaml").archs[args.scale]
    print(f"FFN fwd+bwd, {args.scale} shapes (d={arch.d_model}, d_ff={arch.d_ff}, V={arch.vocab_size}), "
          f"{args.tokens} tokens, device {args.device}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'ffn':6} {'table grad':10} {'ms':>9} {'vs dense':>9}")
    for r in rows:
        print(f"{r['ffn']:6} {r['table_grad']:10} {1e3 * r['seconds']:9.2f} {r['ratio_vs_dense']:9.3f}")
    print("accounting: STEM matmul FLOPs / dense = 2/3 = 0.667 (the table lookup counts as zero FLOPs)")


def bench_attention(seq_len: int = 1024, micro_batch: int = 4, repeats: int = 5, scale: str = "1b",
                    stage: str = "extend", experiment: str = "tiny") -> dict:
    """Attention fwd+bwd time of all layers of one micro-batch: document mask vs plain causal."""

    exp = load(C.REPO / "config" / f"{experiment}.yaml")
    model = build_model(C.model_config_for(exp, scale, baseline_variant(exp.variant_overrides), stage))
    attn = model.layers[0].attn
    torch.manual_seed(0)
    x = torch.randn(micro_batch, seq_len, model.cfg.d_model, requires_grad=True)
    # documents of 50-400 tokens, as packed rows of the extension stage look
    g = torch.Generator().manual_seed(0)
    docs = [torch.repeat_interleave(torch.arange(seq_len), torch.randint(50, 400, (seq_len,), generator=g))[:seq_len]
            for _ in range(micro_batch)]
    positions = torch.from_numpy(np.stack([positions_from_docs(d.numpy()) for d in docs]))
    cos, sin = rope_cos_sin(positions, model.inv_freq)

    def run(mask):
        return _median_seconds(lambda: attn(x, cos, sin, mask).sum().backward(), repeats) * model.cfg.n_layers

    mask_build = time.perf_counter()
    mask = model.document_mask(document_ids(positions))
    mask_build = time.perf_counter() - mask_build
    return {"seq_len": seq_len, "micro_batch": micro_batch, "n_layers": model.cfg.n_layers,
            "causal_s": run(None), "document_mask_s": run(mask), "mask_build_s": mask_build}


def main_attention(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    r = bench_attention(seq_len=args.tokens if args.tokens != 2048 else 1024, repeats=args.repeats)
    print(f"attention fwd+bwd per micro-batch ({r['micro_batch']} x {r['seq_len']} tokens, {r['n_layers']} layers, "
          f"tiny 1b-extend shapes, CPU, {torch.get_num_threads()} threads, median of {args.repeats})")
    print(f"plain causal (SDPA is_causal):  {1e3 * r['causal_s']:8.2f} ms")
    print(f"document mask (SDPA bool mask): {1e3 * r['document_mask_s']:8.2f} ms   "
          f"ratio {r['document_mask_s'] / r['causal_s']:.2f}   (+ mask build {1e3 * r['mask_build_s']:.2f} ms once a step)")


# ---- the whole training step ----------------------------------------------------------------------
# (path, its variant: None for the baseline, stem.config.baseline_variant; its table update)
TRAIN_PATHS = (("dense", None, "dense"), ("stem", "stem", "dense"), ("stem_sparse", "stem", "sparse"))


def _train_models(scale: str, n_layers: int, dev):
    """{path: (model, optimizer, optim spec)} at ``scale``'s shapes with ``n_layers`` layers, one seed."""
    exp = load(C.REPO / "config" / "paper.yaml")
    arch, variants = {**C.mapping(exp.archs[scale]), "n_layers": n_layers}, exp.variants()
    out = {}
    for name, variant, update in TRAIN_PATHS:
        torch.manual_seed(0)
        model = build_model(model_config(arch, variants[variant or C.baseline_variant(exp)].model_spec()), dev)
        optim = {**C.mapping(exp.optim), "table_update": update}
        configure_table_update(model, optim)
        out[name] = (model, build_optimizer(model, optim, 1e-4, fused=dev.type == "cuda"), optim)
    return out, exp


def bench_train(scale: str = "350m", n_layers: int = 3, micro_tokens=(256, 1024), repeats: int = 3,
                device: str = "cpu") -> dict:
    """One training step = one micro-batch of each size in ``micro_tokens`` (accumulated) + clipping + AdamW.
    Each piece is timed separately; the paths run in turn inside every repeat (interleaved), medians kept.
    Two micro-batch sizes give each path's cost per token (slope) and per micro-batch (intercept).
    On the CPU the clock is the process's CPU time (``time.process_time``: other processes on a shared
    machine do not inflate it; with several threads it is their sum), on CUDA wall time after a synchronize."""
    dev = torch.device(device)
    models, exp = _train_models(scale, n_layers, dev)
    ctx = distributed.DistContext(device=dev)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(0, models["dense"][0].cfg.vocab_size, (1, n + 1), generator=g)) for n in micro_tokens]
    batches = [(b[:, :-1].to(dev), b[:, 1:].to(dev)) for b in batches]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    clock = time.perf_counter if dev.type == "cuda" else time.process_time
    times = {name: {"micro": [[] for _ in micro_tokens], "optim": []} for name in models}

    def step(name, record):
        model, opt, optim = models[name]
        for i, (x, y) in enumerate(batches):
            sync()
            t = clock()
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
                loss = model(x, y)
            (loss / len(batches)).backward()
            sync()
            if record:
                times[name]["micro"][i].append(clock() - t)
        t = clock()
        distributed.clip_grad_norm_(model, optim["grad_clip"], ctx)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if record:
            times[name]["optim"].append(clock() - t)

    for r in range(repeats + 1):          # the first round warms up (allocations, optimizer state)
        for name in models:
            step(name, record=r > 0)
    acct = {name: accounting(m) for name, (m, _, _) in models.items()}
    unique = int(torch.cat([x.flatten() for x, _ in batches]).unique().numel())
    rows, per_repeat = {}, {}
    for name, t in times.items():
        rows[name] = {**_components([statistics.median(ts) for ts in t["micro"]], statistics.median(t["optim"]),
                                    micro_tokens),
                      "active_params": acct[name]["active_params"], "total_params": acct[name]["total_params"]}
        per_repeat[name] = [_components([ts[i] for ts in t["micro"]], t["optim"][i], micro_tokens)
                            for i in range(repeats)]
    return {"scale": scale, "n_layers": n_layers, "micro_tokens": list(micro_tokens), "repeats": repeats,
            "device": device, "clock": "wall" if dev.type == "cuda" else "CPU",
            "threads": torch.get_num_threads(), "unique_ids": unique, "rows": rows, "per_repeat": per_repeat,
            "arch": C.mapping(exp.archs[scale]), "stage": C.mapping(exp.stages["pretrain"][scale]),
            "stem_layers": acct["stem"]["sparse_layers"]}


def _components(micro_s: list, optim_s: float, micro_tokens) -> dict:
    """A step's pieces, and the cost per token and per micro-batch from the line through the two sizes."""
    (n1, n2), (t1, t2) = micro_tokens[:2], micro_s[:2]
    per_token = (t2 - t1) / (n2 - n1)
    return {"micro_s": list(micro_s), "optim_s": optim_s, "step_s": sum(micro_s) + optim_s,
            "per_token_s": per_token, "per_micro_batch_s": t1 - per_token * n1}


def expected_unique(vocab: int, tokens: int) -> float:
    """Expected number of distinct ids among ``tokens`` uniform draws from ``vocab`` (an upper bound for text,
    whose Zipfian ids repeat more)."""
    return vocab * -math.expm1(tokens * math.log1p(-1 / vocab))


def project(r: dict, rows: dict | None = None) -> dict:
    """Step time at the paper's tokens per optimizer step T (batch_size x seq_len of the scale's pretraining,
    one device holding the whole batch in micro-batches of micro_batch x seq_len):
    T x per-token + (T / micro tokens) x max(per-micro-batch, 0) + optimizer step. The sparse path's
    per-micro-batch and optimizer terms are scaled up by uniq(T) / uniq(bench) (as if they were all
    proportional to the unique rows they touch: an upper bound), uniq by uniform draws (expected_unique).
    ``rows``: {path: components} (default: the medians, ``r["rows"]``; one repeat's for its own projection)."""
    st, vocab = r["stage"], r["arch"]["vocab_size"]
    tokens = st["batch_size"] * st["seq_len"]
    micro = st["micro_batch"] * st["seq_len"]
    grow = expected_unique(vocab, tokens) / r["unique_ids"]
    out = {"tokens": tokens, "micro_tokens": micro, "unique_growth": grow, "rows": {}}
    for name, row in (rows or r["rows"]).items():
        scale = grow if name == "stem_sparse" else 1.0
        per_micro = tokens / micro * max(row["per_micro_batch_s"], 0.0) * scale
        optim = row["optim_s"] * scale
        total = tokens * row["per_token_s"] + per_micro + optim
        out["rows"][name] = {"step_s": total, "fixed_share": (per_micro + optim) / total}
    return out


def main_train(args):
    if args.threads:
        torch.set_num_threads(args.threads)
    r = bench_train(args.scale, args.layers, tuple(args.micro_tokens), args.repeats, args.device)
    p = project(r)
    a, rows = r["arch"], r["rows"]
    base, flop = rows["dense"], rows["stem"]["active_params"] / rows["dense"]["active_params"]
    print(f"training step (fwd + bwd + clip + AdamW), {r['scale']} shapes (d={a['d_model']}, d_ff={a['d_ff']}, "
          f"V={a['vocab_size']}), {r['n_layers']} layers, STEM in layer(s) {r['stem_layers']}; micro-batches of "
          f"{' + '.join(map(str, r['micro_tokens']))} tokens ({r['unique_ids']} unique ids), device {r['device']}, "
          f"{r['threads']} threads, {r['clock']} time, median of {r['repeats']} interleaved repeats")
    print(f"{'path':12} {'step ms':>9} {'vs dense':>9} {'fwd+bwd ms':>11} {'optim ms':>9} {'us/token':>9} "
          f"{'ms/micro':>9} {'params M':>9}")
    for name, row in rows.items():
        print(f"{name:12} {1e3 * row['step_s']:9.1f} {row['step_s'] / base['step_s']:9.3f} "
              f"{1e3 * sum(row['micro_s']):11.1f} {1e3 * row['optim_s']:9.1f} {1e6 * row['per_token_s']:9.2f} "
              f"{1e3 * row['per_micro_batch_s']:9.2f} {row['total_params'] / 1e6:9.1f}")
    print(f"accounting: training FLOPs STEM / dense = active params {rows['stem']['active_params']:,} / "
          f"{base['active_params']:,} = {flop:.3f}")
    reps = r["per_repeat"]

    def spread(name, fn):   # the ratio to dense within each repeat (interleaved): median [min, max]
        v = sorted(fn(reps[name][i]) / fn(reps["dense"][i]) for i in range(r["repeats"]))
        return statistics.median(v), v[0], v[-1]
    for name in ("stem", "stem_sparse"):
        step, per_tok = spread(name, lambda c: c["step_s"]), spread(name, lambda c: c["per_token_s"])
        print(f"{name} / dense, per repeat: step {step[0]:.3f} [{step[1]:.3f}, {step[2]:.3f}], "
              f"per token (slope) {per_tok[0]:.3f} [{per_tok[1]:.3f}, {per_tok[2]:.3f}]")
    sparse = spread("stem_sparse", lambda c: c["step_s"])[0]
    print(f"target STEM sparse <= FLOP ratio x dense: measured {sparse:.3f} (median of the per-repeat ratios) vs "
          f"{flop:.3f}: {'met' if sparse <= flop else 'NOT met'}")
    pb = p["rows"]["dense"]["step_s"]
    print(f"projected at the paper's {p['tokens']:,} tokens per optimizer step (micro-batches of "
          f"{p['micro_tokens']:,} tokens; sparse path's unique-row terms x{p['unique_growth']:.1f}):")
    for name, row in p["rows"].items():
        print(f"  {name:12} {row['step_s']:10.1f} s  vs dense {row['step_s'] / pb:.3f}  "
              f"(per-micro-batch + optimizer terms {100 * row['fixed_share']:.3f} % of the step)")
    each = sorted((q := project(r, {n: reps[n][i] for n in reps}))["rows"]["stem_sparse"]["step_s"]
                  / q["rows"]["dense"]["step_s"] for i in range(r["repeats"]))
    ps = statistics.median(each)
    print(f"projected target STEM sparse <= {flop:.3f} x dense: {ps:.3f} (median of the per-repeat projections, "
          f"[{each[0]:.3f}, {each[-1]:.3f}]): {'met' if ps <= flop else 'NOT met'}")
    return r, p
