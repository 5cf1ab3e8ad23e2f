"""Throughput of a training job: tokens/s per GPU (per process) and MFU (model FLOPs utilisation).

MFU = training FLOPs per token x tokens/s per GPU / the GPU's dense bf16 peak. The FLOPs per token are the
model's accounting (``stem.models.accounting.flops_per_token``: 6 x the active parameters that run in matrix
products + attention's 12 x layers x heads x head_dim x seq_len). The peak is ``train.peak_tflops`` when the
spec sets it, else the device's entry in ``PEAK_BF16_TFLOPS``; a device without one (the CPU, an unknown
GPU) gets no MFU, and the summary says why.

``summary.json`` holds the run's mean over its timed steps: total tokens / total step time of the steps after
the first ``WARMUP_STEPS`` (allocator, autotuning and compilation happen there); ``throughput_steps`` names
the steps it covers.
"""
from __future__ import annotations

import re

import torch

# Dense (no structured sparsity) bf16 tensor-core peak per GPU, TFLOPS, from NVIDIA's datasheets (they print
# the "with sparsity" figure, twice these). First match of the pattern in torch.cuda.get_device_name() wins.
PEAK_BF16_TFLOPS = (
    (r"H100 PCIe", 756.0, "NVIDIA H100 datasheet, H100 PCIe: 1,513 TFLOPS bf16 with sparsity"),
    (r"H100 NVL|H200 NVL", 835.0, "NVIDIA H100 / H200 datasheets, NVL: 1,671 TFLOPS bf16 with sparsity"),
    (r"GH200|H200|H100", 989.0, "NVIDIA H100 / H200 datasheets, SXM: 1,979 TFLOPS bf16 with sparsity"),
    (r"B200", 2250.0, "NVIDIA HGX B200 datasheet: 4.5 PFLOPS bf16 per GPU with sparsity"),
    (r"A100", 312.0, "NVIDIA A100 datasheet: 624 TFLOPS bf16 with sparsity"),
    (r"L40S", 362.0, "NVIDIA L40S datasheet: 733 TFLOPS bf16 with sparsity"),
    (r"\bL4\b", 121.0, "NVIDIA L4 datasheet: 242 TFLOPS bf16 with sparsity"),
    (r"\bA10\b", 125.0, "NVIDIA A10 datasheet: 250 TFLOPS bf16 with sparsity"),
)

WARMUP_STEPS = 5   # steps of a job left out of its mean throughput


def known_peak(device_name: str) -> tuple[float, str] | None:
    """(dense bf16 TFLOPS, its source) of a GPU by its CUDA device name; None when the table has no entry."""
    for pattern, tflops, source in PEAK_BF16_TFLOPS:
        if re.search(pattern, device_name):
            return tflops, source
    return None


def device_peak(device: torch.device, override: float | None = None) -> tuple[float | None, str]:
    """(peak TFLOPS or None, where it comes from / why there is none) for a training device."""
    if override is not None:
        return float(override), "train.peak_tflops"
    if device.type != "cuda":
        return None, f"no dense bf16 peak for device {device.type} (set train.peak_tflops to report MFU)"
    name = torch.cuda.get_device_name(device)
    hit = known_peak(name)
    if hit is None:
        return None, f"{name}: not in stem.train.throughput.PEAK_BF16_TFLOPS (set train.peak_tflops)"
    return hit[0], f"{name}: {hit[1]}"


def mfu(flops_per_token: float, tokens_per_s_per_gpu: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation, a fraction of the peak."""
    return flops_per_token * tokens_per_s_per_gpu / (peak_tflops * 1e12)


class Meter:
    """The throughput scalars of one job: ``row`` for a step's metrics row, ``line`` for the progress line,
    ``summary`` for summary.json."""

    def __init__(self, flops_per_token: float, world: int, peak_tflops: float | None, peak_source: str):
        self.flops_per_token, self.world = flops_per_token, world
        self.peak_tflops, self.peak_source = peak_tflops, peak_source

    def row(self, tokens_per_s: float) -> dict:
        per_gpu = tokens_per_s / self.world
        out = {"tokens_per_s_per_gpu": per_gpu}
        if self.peak_tflops is not None:
            out["mfu"] = mfu(self.flops_per_token, per_gpu, self.peak_tflops)
        return out

    def line(self, tokens_per_s: float) -> str:
        """What the progress line adds after the global tok/s: per GPU (under data parallelism) and MFU."""
        r = self.row(tokens_per_s)
        parts = [f"{r['tokens_per_s_per_gpu']:,.0f} tok/s/gpu"] if self.world > 1 else []
        if "mfu" in r:
            parts.append(f"MFU {100 * r['mfu']:.1f}%")
        return f" ({', '.join(parts)})" if parts else ""

    def summary(self, rows: list[dict], tokens_per_step: int) -> dict:
        """Run mean over the rows after the first WARMUP_STEPS (all but the first when there are fewer):
        tokens / step seconds, per GPU; MFU at that rate (None, with the reason, without a peak)."""
        skip = WARMUP_STEPS if len(rows) > WARMUP_STEPS else min(1, max(len(rows) - 1, 0))
        timed = rows[skip:]
        seconds = sum(tokens_per_step / r["tokens_per_s"] for r in timed if r.get("tokens_per_s"))
        per_gpu = len(timed) * tokens_per_step / seconds / self.world if seconds > 0 else None
        return {
            "tokens_per_s_per_gpu": per_gpu,
            "mfu": None if per_gpu is None or self.peak_tflops is None
            else mfu(self.flops_per_token, per_gpu, self.peak_tflops),
            "peak_tflops": self.peak_tflops, "peak_source": self.peak_source,
            "flops_per_token": self.flops_per_token,
            "throughput_steps": f"{timed[0]['step']}-{timed[-1]['step']} (first {skip} left out as warm-up)"
            if timed else None,
        }
