"""A per-GPU peak-memory estimate, printed before training so a job can be sized before submission.

Model state (mixed precision, AdamW): fp32 master weights 4 B + fp32 gradients 4 B + two fp32 Adam
moments 8 B = 16 B per parameter, divided by the ranks it is sharded over: STEM/DSE tables and Hash-MoE
experts always over all ranks, the backbone only under FSDP (DDP replicates it). Under FSDP add the bf16
copies of the two largest units gathered at once (current + prefetched).
Activations per token and layer, bf16, with a fused attention kernel (no T x T matrix): saved tensors of
attention (~8 d) and of the FFN (~2 d + 4 d_ff), i.e. 2 x (10 d + 4 d_ff) bytes; with activation
checkpointing only each layer's input (2 d bytes) is kept, plus one layer's full set during its
recomputation. The LM head adds logits in bf16 and fp32 (6 B x V per token).
An estimate, not a measurement: allocator fragmentation and workspace buffers come on top.
"""
from __future__ import annotations

GIB = 1024 ** 3


def _activation_bytes(cfg, tokens: int, act_ckpt: bool) -> int:
    per_layer = 2 * (10 * cfg.d_model + 4 * cfg.d_ff) * tokens
    if act_ckpt:
        return 2 * cfg.d_model * tokens * cfg.n_layers + per_layer
    return per_layer * cfg.n_layers


def estimate(model, micro_batch: int, seq_len: int, world: int = 1, strategy: str = "fsdp",
             act_ckpt: bool = False) -> dict:
    from stem.train.distributed import sharded_leaf_modules

    cfg, tokens = model.cfg, micro_batch * seq_len
    leaf_modules = sharded_leaf_modules(model)
    leaf = {id(p) for m in leaf_modules for p in m.parameters()}
    n_leaf = sum(p.numel() for p in model.parameters() if id(p) in leaf)
    n_back = sum(p.numel() for p in model.parameters() if id(p) not in leaf)
    params = n_leaf / world + n_back / (world if strategy == "fsdp" else 1)
    units = [sum(p.numel() for p in m.parameters()) for m in leaf_modules]
    if strategy == "fsdp":
        units += [sum(p.numel() for p in b.parameters() if id(p) not in leaf) for b in model.layers]
    gathered = 2 * sum(sorted(units)[-2:]) if world > 1 else 0
    out = {"params_gib": 4 * params / GIB, "grads_gib": 4 * params / GIB, "optimizer_gib": 8 * params / GIB,
           "gathered_bf16_gib": gathered / GIB, "activations_gib": _activation_bytes(cfg, tokens, act_ckpt) / GIB,
           "logits_gib": 6 * cfg.vocab_size * tokens / GIB, "world": world, "strategy": strategy,
           "micro_batch": micro_batch, "seq_len": seq_len, "activation_checkpointing": act_ckpt,
           "total_params": n_leaf + n_back, "sharded_table_params": n_leaf}
    out["total_gib"] = sum(out[k] for k in ("params_gib", "grads_gib", "optimizer_gib", "gathered_bf16_gib",
                                            "activations_gib", "logits_gib"))
    return out


def describe(e: dict) -> str:
    return (f"per-GPU memory estimate at world {e['world']} ({e['strategy']}, micro-batch {e['micro_batch']} x "
            f"{e['seq_len']}{', act. ckpt' if e['activation_checkpointing'] else ''}): {e['total_gib']:.1f} GiB = "
            f"params {e['params_gib']:.2f} + grads {e['grads_gib']:.2f} + optimizer {e['optimizer_gib']:.2f} + "
            f"gathered bf16 {e['gathered_bf16_gib']:.2f} + activations {e['activations_gib']:.2f} + "
            f"logits {e['logits_gib']:.2f}")
