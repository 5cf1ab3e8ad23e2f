"""Benchmarks that print figures (ratios measured in one run), never asserted by tests.

``python -m stem bench ffn``: forward+backward time of one STEM FFN layer vs one dense SwiGLU layer at
a scale's real shapes (default 350M: d 960, d_ff 2560, V 32000), STEM's table gradient dense and
sparse, and the FLOP ratio the accounting predicts (2 d d_ff vs 3 d d_ff per token).
"""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from stem import config as C
from stem.models.ffn import build_ffn


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
    cfg = C.model_config_for(C.load_experiment(C.REPO / "config" / "paper.yaml"), scale, "dense")
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    x = torch.randn(1, tokens, cfg.d_model, device=dev, dtype=dtype, requires_grad=True)
    ids = torch.randint(0, cfg.vocab_size, (1, tokens), device=dev)
    rows = []
    for kind, sparse in [("dense", False), ("stem", False), ("stem", True)]:
        with torch.device(dev):
            ffn = build_ffn(kind, cfg, 0).to(dtype)
        if sparse:  # the embedding's sparse backward alone (training has no sparse-gradient optimizer path)
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
    cfg = C.load_experiment(C.REPO / "config" / "paper.yaml")["archs"][args.scale]
    print(f"FFN fwd+bwd, {args.scale} shapes (d={cfg['d_model']}, d_ff={cfg['d_ff']}, V={cfg['vocab_size']}), "
          f"{args.tokens} tokens, device {args.device}, {torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'ffn':6} {'table grad':10} {'ms':>9} {'vs dense':>9}")
    for r in rows:
        print(f"{r['ffn']:6} {r['table_grad']:10} {1e3 * r['seconds']:9.2f} {r['ratio_vs_dense']:9.3f}")
    print("accounting: STEM matmul FLOPs / dense = 2/3 = 0.667 (the table lookup counts as zero FLOPs)")


def bench_attention(seq_len: int = 1024, micro_batch: int = 4, repeats: int = 5, scale: str = "1b",
                    stage: str = "extend", experiment: str = "tiny") -> dict:
    """Attention fwd+bwd time of all layers of one micro-batch: document mask vs plain causal."""
    from stem.data.loader import positions_from_docs
    from stem.models.model import build_model, document_ids
    from stem.models.rope import rope_cos_sin

    cfg = C.load_experiment(C.REPO / "config" / f"{experiment}.yaml")
    model = build_model(C.model_config_for(cfg, scale, "dense", stage))
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
    mask = model._document_mask(document_ids(positions))
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
