"""A per-GPU peak-memory estimate, printed before training so a job can be sized before submission.

Model state (mixed precision, AdamW): fp32 master weights 4 B + fp32 gradients 4 B + two fp32 Adam
moments 8 B = 16 B per parameter, divided by the number of ranks it is sharded over (FSDP shards the
backbone; STEM tables and Hash-MoE experts are sharded over all ranks; DDP replicates: shard=1).
Activations per token and layer, bf16, with a fused attention kernel (no T x T matrix):
saved tensors of attention (~8 d) and of the FFN (~2 d + 4 d_ff), i.e. 2 x (10 d + 4 d_ff) bytes;
with activation checkpointing only each layer's input (2 d bytes) is kept, plus one layer's full set
during its recomputation. The LM head adds logits in bf16 and fp32 (6 B x V per token).
An estimate, not a measurement: allocator fragmentation and workspace buffers come on top.
"""
from __future__ import annotations

GIB = 1024 ** 3


def estimate(model, micro_batch: int, seq_len: int, shard_world: int = 1, act_ckpt: bool = False) -> dict:
    cfg = model.cfg
    n_params = sum(p.numel() for p in model.parameters())
    state = 16 * n_params / max(1, shard_world)
    tokens = micro_batch * seq_len
    per_layer = 2 * (10 * cfg.d_model + 4 * cfg.d_ff) * tokens
    if act_ckpt:
        acts = 2 * cfg.d_model * tokens * cfg.n_layers + per_layer
    else:
        acts = per_layer * cfg.n_layers
    logits = 6 * cfg.vocab_size * tokens
    total = state + acts + logits
    return {"params_grads_optimizer_gib": state / GIB, "activations_gib": acts / GIB, "logits_gib": logits / GIB,
            "total_gib": total / GIB, "shard_world": shard_world, "activation_checkpointing": act_ckpt}


def describe(est: dict) -> str:
    return (f"estimated peak memory per GPU: {est['total_gib']:.1f} GiB (model state "
            f"{est['params_grads_optimizer_gib']:.1f} over {est['shard_world']} rank(s), activations "
            f"{est['activations_gib']:.1f}{' with checkpointing' if est['activation_checkpointing'] else ''}, "
            f"logits {est['logits_gib']:.1f})")
