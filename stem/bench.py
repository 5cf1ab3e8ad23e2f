"""Benchmarks that print figures (ratios measured in one run), never asserted by tests.

``python -m stem bench ffn``: forward+backward time of one STEM FFN layer vs one dense SwiGLU layer at
a scale's real shapes (default 350M: d 960, d_ff 2560, V 32000), STEM's table gradient dense and
sparse, and the FLOP ratio the accounting predicts (2 d d_ff vs 3 d d_ff per token).
"""
from __future__ import annotations

import dataclasses
import statistics
import time

import torch

from stem import config as C
from stem.models.ffn import build_ffn


def _time_fwd_bwd(ffn, x, ids, repeats: int, device) -> float:
    def once():
        ffn.zero_grad(set_to_none=True)
        ffn(x, ids).sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()

    for _ in range(2):
        once()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        once()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_ffn(scale: str = "350m", tokens: int = 2048, repeats: int = 5, device: str = "cpu") -> list[dict]:
    cfg = C.model_config_for(C.load_experiment(C.REPO / "config" / "paper.yaml"), scale, "dense")
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    x = torch.randn(1, tokens, cfg.d_model, device=dev, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=dev)
    rows = []
    for kind, sparse in [("dense", False), ("stem", False), ("stem", True)]:
        c = dataclasses.replace(cfg, table_sparse_grad=sparse)
        with torch.device(dev):
            ffn = build_ffn(kind, c, 0).to(dtype)
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
    cfg = C.load_experiment(C.REPO / "config" / "paper.yaml")["archs"][args.scale]
    print(f"FFN fwd+bwd, {args.scale} shapes (d={cfg['d_model']}, d_ff={cfg['d_ff']}, V={cfg['vocab_size']}), "
          f"{args.tokens} tokens, device {args.device}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'ffn':6} {'table grad':10} {'ms':>9} {'vs dense':>9}")
    for r in rows:
        print(f"{r['ffn']:6} {r['table_grad']:10} {1e3 * r['seconds']:9.2f} {r['ratio_vs_dense']:9.3f}")
    print("accounting: STEM matmul FLOPs / dense = 2/3 = 0.667 (the table lookup counts as zero FLOPs)")
