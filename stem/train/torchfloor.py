"""The PyTorch the GPU path needs, stated by feature (issue 31): a node's own PyTorch (``TORCH=system``) that
lacks one is one line naming the feature and the release that has it, before anything runs
(``python -m stem gpucheck``, ``python -m stem train`` on CUDA, and ``make ... TORCH=system`` before it installs
anything: ``python -m stem.train.torchfloor``), not a traceback deep inside a job.

The releases are where each feature first appeared in PyTorch's public API (the release notes; ``ignored_params``:
torch 2.7). The test suite ran on torch 2.11 and 2.13 (docs/gpu.md).
"""
from __future__ import annotations

import importlib
import inspect
import os
import sys

import torch


def _attr(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def _fully_shard_ignored_params() -> bool:
    fn = _attr("torch.distributed.fsdp", "fully_shard")
    return fn is not None and "ignored_params" in inspect.signature(fn).parameters


def _sdpa_gqa() -> bool:
    return "enable_gqa" in (torch.nn.functional.scaled_dot_product_attention.__doc__ or "")


# (feature, where the code uses it, the first release that has it, present?)
FEATURES = [
    ("flex attention with block masks", "torch.nn.attention.flex_attention.create_block_mask", "2.5",
     lambda: _attr("torch.nn.attention.flex_attention", "create_block_mask") is not None),
    ("grouped-query scaled_dot_product_attention", "enable_gqa=", "2.5", _sdpa_gqa),
    ("FSDP2 fully_shard with ignored_params", "torch.distributed.fsdp.fully_shard", "2.7",
     _fully_shard_ignored_params),
    ("FSDP2 mixed precision", "torch.distributed.fsdp.MixedPrecisionPolicy", "2.6",
     lambda: _attr("torch.distributed.fsdp", "MixedPrecisionPolicy") is not None),
    ("public DTensor", "torch.distributed.tensor.DTensor", "2.5",
     lambda: _attr("torch.distributed.tensor", "DTensor") is not None),
    ("DCP state dicts", "torch.distributed.checkpoint.state_dict.set_state_dict", "2.4",
     lambda: _attr("torch.distributed.checkpoint.state_dict", "StateDictOptions") is not None),
    ("device meshes", "torch.distributed.device_mesh.init_device_mesh", "2.2",
     lambda: _attr("torch.distributed.device_mesh", "init_device_mesh") is not None),
    ("nn.Module.compile", "torch.nn.Module.compile", "2.2", lambda: hasattr(torch.nn.Module, "compile")),
    ("nn.RMSNorm", "torch.nn.RMSNorm", "2.4", lambda: hasattr(torch.nn, "RMSNorm")),
    ("device-generic OutOfMemoryError", "torch.OutOfMemoryError", "2.5", lambda: hasattr(torch, "OutOfMemoryError")),
]


def missing() -> list[str]:
    """One line per feature this torch lacks."""
    return [f"torch {torch.__version__} lacks {name} ({where}): torch >= {release} has it"
            for name, where, release, present in FEATURES if not present()]


def require():
    """Raises ValueError (one line: the first missing feature, and how many more) unless every feature is here."""
    lacks = missing()
    if lacks:
        more = f" (and {len(lacks) - 1} more feature(s))" if len(lacks) > 1 else ""
        raise ValueError(lacks[0] + more)


if __name__ == "__main__":   # make TORCH=system: the machine's torch, before anything is installed beside it
    lacks = missing()
    if lacks:
        print(f"error: {lacks[0]}", file=sys.stderr)
        sys.exit(1)
    print(f"torch {torch.__version__}: every PyTorch feature of the GPU path (stem/train/torchfloor.py)")


# The environment variables that change which kernels compute a job's numbers (docs/confidence.md).
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")


def runtime(device, dtype, **more) -> dict:
    """What a job's numbers were computed with, for its result JSON (issue 39: nothing runs elsewhere silently):
    the device and dtype actually used, intra-op threads, the CPU kernels' instruction set, whether deterministic
    algorithms were on, the kernel-selecting environment variables that are set, and ``more`` (the caller's:
    the requested device, autocast, compile, the attention path)."""
    return {"device": str(device), "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "env": {k: os.environ[k] for k in KERNEL_ENV if k in os.environ}, **more}
