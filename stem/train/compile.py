"""Compiled training (``train.compile: true``): each transformer block compiled with ``torch.compile``.

The wrapping order is torchtitan's: activation checkpointing outside (the model's forward calls
``torch.utils.checkpoint.checkpoint`` on each block), the block compiled inside it, FSDP around both
(``stem.train.distributed.parallelize`` runs after ``compile_blocks``). Each block is compiled in place
(``nn.Module.compile``), so parameter names and checkpoints do not change. The blocks share one code object;
their layer index and shapes become dynamic after the first recompilation, so a handful of graphs serve all
blocks (the recompilation limit is raised to the number of layers so no block falls back to eager).

The STEM lookup and DSE hashing compile inside their block; what dynamo cannot trace is a graph break,
counted by ``graph_breaks`` (torch._dynamo's counters) and reported by the loop after its first step.
"""
from __future__ import annotations



def compile_blocks(model) -> None:
    """Compile every block of ``model`` in place (call after ``set_training_options``, before sharding)."""
    import torch._dynamo   # lazy: 1.5 s of imports that every eager training job would pay
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, name, max(getattr(cfg, name), 2 * len(model.layers)))
    for block in model.layers:
        block.compile()


def graph_breaks() -> dict:
    """{reason: count} of the graph breaks torch._dynamo has met in this process."""
    from torch._dynamo.utils import counters   # torch._dynamo: heavy, only when graph breaks are asked for
    return dict(counters["graph_break"])


def describe_breaks(breaks: dict) -> str:
    if not breaks:
        return "torch.compile: no graph breaks"
    top = sorted(breaks.items(), key=lambda kv: -kv[1])[:3]
    return (f"torch.compile: {sum(breaks.values())} graph break(s), {len(breaks)} reason(s); most frequent: "
            + "; ".join(f"{n} x {r.splitlines()[0][:120]}" for r, n in top))
