"""Evaluator speed: loglikelihood requests/s and greedy generation tokens/s with/without KV cache.

    python -m stem eval --bench --checkpoint results/tiny/1b/stem/extend/checkpoint   (stem.__main__.cmd_eval)
"""
from __future__ import annotations

import random
import time

import torch

from stem.eval.generate import greedy_generate, greedy_generate_batch
from stem.eval.lm import StemLM


def bench(checkpoint, device=None, n_requests: int = 512, ctx_tokens: int = 96, cont_tokens: int = 4,
          prompt_tokens: int = 128, gen_tokens: int = 64, repeats: int = 3) -> dict:
    lm = StemLM(str(checkpoint), device=device)
    rng = random.Random(0)
    vocab = lm.tok.vocab_size
    reqs = [(None, [rng.randrange(vocab) for _ in range(rng.randint(ctx_tokens // 2, ctx_tokens))],
             [rng.randrange(vocab) for _ in range(cont_tokens)]) for _ in range(n_requests)]
    lm._loglikelihood_tokens(reqs[:32])  # warm-up
    t = time.perf_counter()
    lm._loglikelihood_tokens(reqs)
    ll_rate = n_requests / (time.perf_counter() - t)

    prompt = [rng.randrange(vocab) for _ in range(min(prompt_tokens, lm.max_length - gen_tokens))]
    rates = {}
    for cached in (True, False):
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            out = greedy_generate(lm.model, prompt, gen_tokens, eos_id=None, use_cache=cached)
            best = max(best, len(out) / (time.perf_counter() - t))
        rates["with_kv_cache" if cached else "without_kv_cache"] = round(best, 1)
    prompts = [[rng.randrange(vocab) for _ in range(len(prompt))] for _ in range(lm.batch_size)]
    t = time.perf_counter()
    n = sum(len(g) for g in greedy_generate_batch(lm.model, prompts, gen_tokens, eos_id=None))
    rates[f"with_kv_cache_batch_{lm.batch_size}"] = round(n / (time.perf_counter() - t), 1)
    return {"checkpoint": str(checkpoint), "device": str(lm.device), "threads": torch.get_num_threads(),
            "batch_size": lm.batch_size,
            "loglikelihood_requests_per_s": round(ll_rate, 1),
            "loglikelihood_request": {"context_tokens": f"{ctx_tokens // 2}-{ctx_tokens}", "continuation_tokens": cont_tokens},
            "generate_tokens_per_s": rates, "generate": {"prompt_tokens": len(prompt), "new_tokens": gen_tokens}}
