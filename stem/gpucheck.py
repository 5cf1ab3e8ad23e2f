"""``python -m stem gpucheck`` (``make gpu-check``): the paper path on a real GPU in minutes.

Each item is a function ``item_x(ctx) -> dict`` (``ok``, ``figure``: the one-line result, ``details``). On
CUDA they run at the paper's shapes; with ``--tiny`` (the tests, and the CPU) at tiny shapes of the same
architectures, through the same code. The results go to ``reports/gpucheck/gpucheck.{json,md}`` (atomic
writes), with the device name and the torch / CUDA versions.

- a. bf16 training of every variant (350M shapes, full depth): 20 steps on one fixed batch through the loop's
  ``train_step`` and the job's optimizer groups; loss finite and falling, every group a non-zero gradient.
- b. document masks: a packed row's logits equal those of its documents run one by one (the dense-mask SDPA
  path), and on CUDA flex attention equals the SDPA path; one packed row at the extend stage's length
  (1B shapes, 32,768 tokens, activation checkpointing) forward + backward gives a finite loss.
- c. resume: the loop's state saved after k steps by a child process (FSDP2 + DCP under torchrun when
  several GPUs are visible), the child killed with SIGKILL, resumed here: step k+1's loss equals the
  uninterrupted run's, and the child's steps equal the single-process steps.
- d. memory: the traced per-GPU peak (``stem.train.memtrace.trace``, what ``python -m stem memory`` prints)
  against ``torch.cuda.max_memory_allocated`` of the same step (within 10 %); on the CPU the trace alone.
- e. throughput: tokens/s and MFU of one training step, dense vs STEM, 350M and 1B shapes, at the paper's
  sequence length and the largest micro-batch that fits; eager and compiled; STEM/dense step-time ratio
  beside the accounting's FLOP ratio; targets: dense 1B MFU >= 40 %, STEM within 5 points.
- f. offload: STEM tables in (pinned) host memory served by the offload engine give the resident logits;
  decode tokens/s resident / offloaded / offloaded + cache, batch 1 and 16, prefetch on and off.
- g. evaluation: the registered lm-eval model (``stem.eval.lm.StemLM``) scores the same requests on this
  device as on the CPU in fp32, and within ``BF16_LOGLIK_TOL`` in bf16.

Before each item its predicted cost (``predict``: the FLOPs of its steps at its shapes over a timed matrix
product's rate, plus fixed costs per model, compilation, step and child process) is printed; with a budget
(``--budget SECONDS``) the items run in ``VALUE_ORDER`` and one that would not fit the time left is skipped
with one line. The JSON and Markdown are rewritten after every item, so a run killed at its allocation's end
keeps every finished figure.
"""
from __future__ import annotations

import copy
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from stem import config as C
from stem import layout as L
from stem import provenance
from stem.bench.offload import decode_seconds
from stem.checkpoint import save_checkpoint
from stem.data.synth import make_world, web_documents
from stem.data.tokenizer import train_bpe
from stem.config.experiment import Experiment, parse
from stem.io import atomic_write_json, atomic_write_text
from stem.models.accounting import accounting, flops_per_token
from stem.models.model import build_model
from stem.models.offload import offload
from stem.optim import OptimSpec, build_optimizer, configure_table_update
from stem.specs import TrainSpec
from stem.train import distributed, memtrace, throughput
from stem.train.compile import compile_blocks
from stem.train.plan import ParallelPlan, place
from stem.train.step import accumulate_gradients, make_optimizer, train_step

# Item a's variants: every variant of config/variants.yaml that is a model of its own, trained from scratch (not a
# mid-training insertion, not another optimizer setting of a listed model); the dense comparisons use the baseline.
VARIANTS = tuple(name for name, v in C.specs.variants({}).items() if v.insert is None and v.optim is None)
BASELINE = C.baseline_variant()
ITEMS = "abcdefg"
VALUE_ORDER = "aebdfgc"   # --budget: training of every variant, throughput, masks, memory, offload, eval, resume
A_STEPS = {"paper": 20, "tiny": 5}                 # item a's steps
E_MICRO = (16, 8, 4, 2, 1)                         # item e: the largest micro-batch of these that fits
E_REPEATS = {"paper": (5, 3), "tiny": (1, 1)}      # item e: timed steps, warm-up steps
F_DECODE = {"paper": ((1, 16), (64, 128)), "tiny": ((1, 2), (8, 16))}   # item f: batches, (decoded, prompt tokens)
BF16_LOGLIK_TOL = 0.05     # item g: |log-likelihood bf16 - fp32| per request, nats (bf16 keeps ~3 digits)
MEMORY_TOL = 0.10          # item d
TARGET_DENSE_MFU, TARGET_STEM_GAP = 0.40, 0.05   # item e
TINY_ARCH = dict(vocab_size=512, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96, max_seq_len=512)


@dataclass
class Ctx:
    device: torch.device
    tiny: bool
    work: Path                      # scratch folder (checkpoints, states)
    peak_tflops: float | None = None
    compile: bool = True            # item e also times the compiled model
    variants: tuple = VARIANTS      # item a's variants (the tests pick a few)
    require_mfu: float | None = None   # item e fails below this dense 1B MFU (--require-mfu)

    @property
    def shapes(self) -> str:
        return "tiny" if self.tiny else "paper"

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def autocast(self):
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cuda)

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize(self.device)


def experiment(tiny: bool) -> Experiment:
    """The paper config; ``tiny``: the same architectures and stages at tiny widths and lengths."""
    path = C.REPO / "config" / "paper.yaml"
    raw = C.read_yaml(path)
    if tiny:
        for scale in raw["archs"]:
            raw["archs"][scale].update(TINY_ARCH)
        raw["variant_overrides"] = {"hashmoe": {"n_experts": 4}, "moe": {"moe_experts": 4, "moe_d_ff": 24},
                                    "dse": {"dse": {"rows_per_head": 101, "d_mem": 16, "heads": 2}}}
        for stage in raw["stages"].values():
            for st in stage.values():
                st.update(seq_len=min(st["seq_len"], 64 if st["seq_len"] <= 4096 else 256), micro_batch=2,
                          batch_size=4)
                if "max_seq_len" in st:
                    st["max_seq_len"] = 256
    return parse(raw, str(path))


def model_cfg(cfg: Experiment, scale: str, variant: str, stage: str = "pretrain"):
    return C.model_config_for(cfg, scale, variant, stage)


def _batch(vocab: int, rows: int, seq: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return x[:, :-1].to(device), x[:, 1:].to(device)


def _optim(cfg: Experiment) -> OptimSpec:
    return cfg.optim   # the config's optim section is the job spec's class (stem.optim.OptimSpec)


def _optimizer(model, cfg: Experiment, lr: float, ctx: Ctx):
    configure_table_update(model, _optim(cfg))
    return build_optimizer(model, _optim(cfg), lr, fused=ctx.cuda)


def _free(ctx: Ctx):
    if ctx.cuda:
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- a
def item_a(ctx: Ctx) -> dict:
    cfg = experiment(ctx.tiny)
    st = cfg.stages["pretrain"]["350m"]
    steps = A_STEPS[ctx.shapes]
    dctx = distributed.DistContext(device=ctx.device)
    rows, bad = {}, []
    for variant in ctx.variants:
        torch.manual_seed(0)
        mcfg = model_cfg(cfg, "350m", variant)
        model = build_model(mcfg, ctx.device)
        model.set_training_options(activation_checkpointing=bool(st.activation_checkpointing))
        opt = _optimizer(model, cfg, st.lr, ctx)
        x, y = _batch(mcfg.vocab_size, min(st.micro_batch, 4), st.seq_len, ctx.device)
        batches = [(x, y, None)]
        model.train()
        first = accumulate_gradients(model, batches, dctx, ctx.device, ctx.autocast())
        zero = [g for g, ps in model.param_groups().items()
                if not any(p.grad is not None and float(_dense(p.grad).abs().sum()) > 0 for p in ps)]
        distributed.clip_grad_norm_(model, cfg.optim.grad_clip or float("inf"), dctx)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses = [first]
        for i in range(1, steps):
            losses.append(train_step(model, opt, batches, dctx, ctx.autocast(), st.lr, cfg.optim.grad_clip,
                                     i)[0])
        ok = all(map(_finite, losses)) and losses[-1] < losses[0] and not zero
        rows[variant] = {"first_loss": losses[0], "last_loss": losses[-1], "groups": sorted(model.param_groups()),
                         "groups_without_gradient": zero}
        if not ok:
            bad.append(variant)
        del model, opt
        _free(ctx)
    figure = (f"{len(ctx.variants) - len(bad)}/{len(ctx.variants)} variants: loss falls over {steps} steps, "
              f"every group "
              f"has a gradient" + (f"; failed: {', '.join(bad)}" if bad else ""))
    return {"ok": not bad, "figure": figure, "details": rows}


def _dense(g):
    return g.coalesce().values() if g.is_sparse else g


def _finite(v: float) -> bool:
    return v == v and abs(v) != float("inf")


# ---------------------------------------------------------------------------------------------- b
def _packed_positions(t: int, lengths: list[int], device):
    pos = torch.cat([torch.arange(n) for n in lengths])[:t]
    return pos.unsqueeze(0).to(device)


@torch.no_grad()
def _doc_mask_diffs(ctx: Ctx, model, vocab: int, t: int) -> dict:
    lengths = [t // 4, t // 2, t - t // 4 - t // 2]
    x, _ = _batch(vocab, 1, t, ctx.device, seed=1)
    pos = _packed_positions(t, lengths, ctx.device)
    model.eval()
    with ctx.autocast():
        packed = model(x, positions=pos).float()
        alone, s = [], 0
        for n in lengths:
            alone.append(model(x[:, s:s + n]).float())
            s += n
        out = {"packed_vs_documents": float((packed - torch.cat(alone, dim=1)).abs().max())}
        if ctx.cuda:
            model.set_training_options(flex_attention=True)
            out["flex_vs_sdpa"] = float((model(x, positions=pos).float() - packed).abs().max())
            model.set_training_options(flex_attention=False)
    return out


def item_b(ctx: Ctx) -> dict:
    cfg = experiment(ctx.tiny)
    tol = 0.1 if ctx.cuda else 1e-4         # bf16 logits (~8 bits of mantissa) vs fp32 on the CPU
    torch.manual_seed(0)
    mcfg = model_cfg(cfg, "350m", BASELINE)
    model = build_model(mcfg, ctx.device)
    diffs = _doc_mask_diffs(ctx, model, mcfg.vocab_size, min(cfg.stages["pretrain"]["350m"].seq_len, 2048))
    del model
    _free(ctx)
    st = cfg.stages["extend"]["1b"]
    # dense: the 1B STEM model's fp32 tables and their gradients (~42 GB) with the 32k row's fp32 logits (~34 GB)
    # do not fit one 80 GB GPU unsharded (the paper's extend stage shards them over 32 GPUs)
    mcfg = model_cfg(cfg, "1b", BASELINE, "extend")
    model = build_model(mcfg, ctx.device)
    model.set_training_options(activation_checkpointing=True, flex_attention=ctx.cuda)
    t = st.seq_len
    x, y = _batch(mcfg.vocab_size, 1, t, ctx.device, seed=2)
    pos = _packed_positions(t, [t // 8, t // 2, t], ctx.device)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    t0 = time.perf_counter()
    with ctx.autocast():
        loss = model(x, y, positions=pos)
    loss.backward()
    ctx.sync()
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(ctx.device) / 2**30 if ctx.cuda else None
    del model
    _free(ctx)
    loss = loss.item()
    ok = all(v <= tol for v in diffs.values()) and _finite(loss)
    long_row = (f"1B dense packed row of {t} tokens fwd+bwd (act. ckpt): loss {loss:.3f}, {seconds:.1f} s"
                + (f", peak {peak:.1f} GiB" if peak is not None else ""))
    figure = ", ".join(f"{k} max |dlogit| {v:.2g}" for k, v in diffs.items()) + f" (tol {tol}); {long_row}"
    return {"ok": ok, "figure": figure, "details": {**diffs, "tolerance": tol, "long_row_tokens": t,
                                                     "long_row_loss": loss, "long_row_seconds": seconds,
                                                     "long_row_peak_gib": peak}}


# ---------------------------------------------------------------------------------------------- c
RESUME_STEPS = 3   # steps before the state the child saves; the check compares step RESUME_STEPS + 1
# Item c ramps the stage's lr over this many steps, as a job's warmup does. At the full 350M lr (2e-3) from step 0,
# Adam's third step spiked the loss (10.3 -> 11.1 on an H100) and amplified bf16's run-to-run noise (the CUDA
# embedding backward's atomic adds: 5e-5 at step 2) to a 6 % difference between two identical runs.
RESUME_WARMUP = 10


def _resume_setup(ctx_device: torch.device, tiny: bool, dctx):
    cfg = experiment(tiny)
    st = cfg.stages["pretrain"]["350m"]
    torch.manual_seed(0)
    mcfg = model_cfg(cfg, "350m", "stem")
    model = build_model(mcfg, ctx_device)
    plan = ParallelPlan(dctx.world, "fsdp", 1, 2 * max(dctx.world, 1), st.seq_len,
                        tables=place("fsdp", dctx.world, row_sparse=configure_table_update(model, _optim(cfg))))
    distributed.parallelize(model, dctx, plan)
    opt = distributed.optimizer_for_dtensors(
        build_optimizer(model, _optim(cfg), st.lr, fused=ctx_device.type == "cuda"), plan)
    x, y = _batch(mcfg.vocab_size, 2 * max(dctx.world, 1), st.seq_len, ctx_device, seed=3)
    batches = [(x[i:i + 1], y[i:i + 1], None) for i in range(x.shape[0])]
    return model, opt, batches, st.lr, cfg.optim.grad_clip


def _resume_steps(model, opt, batches, lr, clip, dctx, start: int, stop: int) -> list[float]:
    autocast = torch.autocast(dctx.device.type, dtype=torch.bfloat16, enabled=dctx.device.type == "cuda")
    return [train_step(model, opt, batches, dctx, autocast, lr * min(1.0, (s + 1) / RESUME_WARMUP), clip, s)[0]
            for s in range(start, stop)]


def resume_child(state_dir: str, tiny: bool, device: str):
    """The child of item c (``python -m stem.gpucheck resume-child``): RESUME_STEPS steps, the state saved,
    then it waits to be killed."""
    dctx = distributed.setup(torch.device(device))
    model, opt, batches, lr, clip = _resume_setup(dctx.device, tiny, dctx)
    losses = _resume_steps(model, opt, batches, lr, clip, dctx, 0, RESUME_STEPS)
    distributed.save_state(state_dir, RESUME_STEPS, model, opt, {"losses": losses}, dctx)
    if dctx.is_main:
        atomic_write_json(Path(state_dir) / "saved.json", {"losses": losses, "world": dctx.world})
    time.sleep(600)   # killed here (SIGKILL)


def item_c(ctx: Ctx) -> dict:
    world = max(1, torch.cuda.device_count()) if ctx.cuda else 1
    state = ctx.work / "resume_state"
    cmd = [sys.executable, "-m", "stem.gpucheck", "resume-child", str(state), str(ctx.device.type),
           "--tiny" if ctx.tiny else "--paper"]
    if world > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"] + cmd[1:]
    env = {**os.environ, "PYTHONPATH": str(C.REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = ctx.work / "resume_child.log"
    with open(log, "w") as err:
        child = subprocess.Popen(cmd, cwd=C.REPO, env=env, start_new_session=True, stdout=err, stderr=err)
    deadline = time.time() + 600
    while not (state / "saved.json").is_file():
        if child.poll() is not None or time.time() > deadline:
            err = log.read_text().strip().splitlines()
            if child.poll() is None:
                os.killpg(child.pid, signal.SIGKILL)
            return {"ok": False, "figure": f"the child died before saving its state: {err[-1] if err else '?'}",
                    "details": {"world": world}}
        time.sleep(0.2)
    os.killpg(child.pid, signal.SIGKILL)      # the whole group: torchrun and its ranks
    child.wait()
    saved = json.loads((state / "saved.json").read_text())["losses"]
    dctx = distributed.DistContext(device=ctx.device)
    model, opt, batches, lr, clip = _resume_setup(ctx.device, ctx.tiny, dctx)
    ref = _resume_steps(model, opt, batches, lr, clip, dctx, 0, RESUME_STEPS + 1)
    del model, opt
    model, opt, batches, lr, clip = _resume_setup(ctx.device, ctx.tiny, dctx)
    extra = distributed.load_state(state, model, opt, dctx)
    resumed = _resume_steps(model, opt, batches, lr, clip, dctx, RESUME_STEPS, RESUME_STEPS + 1)[0]
    del model, opt
    _free(ctx)
    tol = 2e-2 if ctx.cuda else 1e-5
    step_dev = max(abs(a - b) / abs(b) for a, b in zip(saved, ref))
    resume_dev = abs(resumed - ref[-1]) / abs(ref[-1])
    ok = extra is not None and extra["step"] == RESUME_STEPS and step_dev <= tol and resume_dev <= tol
    kind = f"FSDP2/DCP at world {world}" if world > 1 else "world 1 (unsharded, single-process state)"
    figure = (f"{kind}: child steps vs single-process rel. dev. {step_dev:.1e}; SIGKILL after step {RESUME_STEPS}, "
              f"resumed step {RESUME_STEPS + 1} loss {resumed:.5f} vs uninterrupted {ref[-1]:.5f} "
              f"(rel. dev. {resume_dev:.1e}, tol {tol})")
    return {"ok": ok, "figure": figure, "details": {"world": world, "child_losses": saved, "reference": ref,
                                                    "resumed_loss": resumed, "tolerance": tol}}


# ---------------------------------------------------------------------------------------------- d
def item_d(ctx: Ctx) -> dict:
    cfg = experiment(ctx.tiny)
    spec = C.train_spec(cfg, "350m", "stem", "pretrain")
    spec["train"].update(micro_batch=2 if ctx.tiny else 8, batch_size=4 if ctx.tiny else 16)
    traced = memtrace.trace(*memtrace.job(spec, 1, "fsdp"), mixed_precision=True)["peak_gib"]
    if not ctx.cuda:
        return {"ok": traced > 0, "figure": f"traced peak {traced * 1024:.1f} MiB (CUDA allocator: not measured "
                                            f"on {ctx.device.type})", "details": {"traced_gib": traced}}
    spec = TrainSpec.from_dict(spec)
    dctx = distributed.DistContext(device=ctx.device)
    torch.manual_seed(0)
    model = build_model(spec.model, ctx.device)
    model.set_training_options(activation_checkpointing=spec.train.activation_checkpointing)
    plan = ParallelPlan.of(spec.train, 1, row_sparse=configure_table_update(model, spec.optim))
    opt = make_optimizer(model, spec, plan, fused=True)
    x, y = _batch(spec.model.vocab_size, spec.train.micro_batch, spec.train.seq_len, ctx.device)
    batches = [(x, y, None)] * 2       # the trace's two micro-batches
    train_step(model, opt, batches, dctx, ctx.autocast(), spec.train.lr, spec.optim.grad_clip)   # Adam state
    torch.cuda.synchronize(ctx.device)
    torch.cuda.reset_peak_memory_stats(ctx.device)
    train_step(model, opt, batches, dctx, ctx.autocast(), spec.train.lr, spec.optim.grad_clip)
    measured = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    del model, opt
    _free(ctx)
    dev = traced / measured - 1
    return {"ok": abs(dev) <= MEMORY_TOL, "figure": f"350M STEM micro-batch {spec.train.micro_batch} x "
            f"{spec.train.seq_len}: traced {traced:.2f} GiB, max_memory_allocated {measured:.2f} GiB ({dev:+.1%}, "
            f"tol {MEMORY_TOL:.0%})", "details": {"traced_gib": traced, "measured_gib": measured}}


# ---------------------------------------------------------------------------------------------- e
def _time_step(ctx: Ctx, model, opt, x, y, repeats: int, warmup: int) -> float:
    dctx = distributed.DistContext(device=ctx.device)
    batches = [(x, y, None)]

    def once():
        train_step(model, opt, batches, dctx, ctx.autocast(), 1e-4, 1.0)
    for _ in range(warmup):   # allocator, autotuning, compilation
        once()
    times = []
    for _ in range(repeats):
        ctx.sync()
        t = time.perf_counter()
        once()
        ctx.sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def throughput_point(ctx: Ctx, cfg: Experiment, scale: str, variant: str, compiled: bool, peak: float | None) -> dict:
    """Tokens/s and MFU of one training step (one micro-batch, the largest that fits of 16, 8, 4, 2, 1)."""
    st = cfg.stages["pretrain"][scale]
    mcfg = model_cfg(cfg, scale, variant)
    acct = accounting(build_model(mcfg, "meta"))
    fpt = flops_per_token(acct, mcfg, st.seq_len)
    state_gib = _state_gib(acct)
    if not _state_fits(ctx, state_gib):
        return {"scale": scale, "variant": variant, "compiled": compiled, "micro_batch": 0, "unsharded_state_gib":
                state_gib, "skipped": f"weights + gradients + AdamW need {state_gib:.0f} GiB unsharded "
                                      "(the paper shards this job over several GPUs)"}
    for micro in ([st.micro_batch] if ctx.tiny else E_MICRO):
        model = opt = None
        try:
            torch.manual_seed(0)
            model = build_model(mcfg, ctx.device)
            model.set_training_options(activation_checkpointing=bool(st.activation_checkpointing))
            if compiled:
                compile_blocks(model)
            opt = _optimizer(model, cfg, 1e-4, ctx)
            x, y = _batch(mcfg.vocab_size, micro, st.seq_len, ctx.device)
            seconds = _time_step(ctx, model, opt, x, y, *E_REPEATS[ctx.shapes])
        except torch.OutOfMemoryError:
            del model, opt
            _free(ctx)
            continue
        del model, opt
        _free(ctx)
        tok_s = micro * st.seq_len / seconds
        return {"scale": scale, "variant": variant, "compiled": compiled, "micro_batch": micro,
                "seq_len": st.seq_len, "step_s": seconds, "tokens_per_s": tok_s, "flops_per_token": fpt,
                "mfu": None if peak is None else throughput.mfu(fpt, tok_s, peak)}
    return {"scale": scale, "variant": variant, "compiled": compiled, "micro_batch": 0, "error": "no micro-batch fits"}


def _state_gib(acct: dict) -> float:
    return 16 * acct["total_params"] / 2**30     # fp32 weights, gradients and AdamW's two moments


def _state_fits(ctx: Ctx, state_gib: float) -> bool:
    return not ctx.cuda or state_gib <= torch.cuda.get_device_properties(ctx.device).total_memory / 2**30


def mfu_target(points: list[dict], peak: float | None, dense_min: float = TARGET_DENSE_MFU) -> tuple[bool | None, str]:
    """(met, text) of item e's target: dense 1B MFU >= ``dense_min`` and STEM within TARGET_STEM_GAP of it
    (judged where STEM ran); met is None without a peak."""
    if peak is None:
        return None, "MFU not measured (no peak: --peak-tflops)"
    met = False
    for d, s in zip(points[::2], points[1::2]):
        if d["scale"] == "1b" and "mfu" in d:
            met = met or (d["mfu"] >= dense_min and ("mfu" not in s or d["mfu"] - s["mfu"] <= TARGET_STEM_GAP))
    return met, (f"targets (dense 1B MFU >= {dense_min:.0%}, STEM within {100 * TARGET_STEM_GAP:.0f} points): "
                 f"{'met' if met else 'NOT met'}")


def item_e(ctx: Ctx) -> dict:
    cfg = experiment(ctx.tiny)
    peak, source = throughput.device_peak(ctx.device, ctx.peak_tflops)
    modes = (False, True) if ctx.compile else (False,)
    points = [throughput_point(ctx, cfg, s, v, c, peak)
              for s in ("350m", "1b") for c in modes for v in (BASELINE, "stem")]
    parts, ok = [], all("error" not in p for p in points)
    for i in range(0, len(points), 2):
        d, s = points[i], points[i + 1]
        mode = "compiled" if d["compiled"] else "eager"
        if "error" in d or "skipped" in d:
            parts.append(f"{d['scale']} {mode} dense: {d.get('error') or d['skipped']}")
            continue
        mfu = "" if peak is None else f" MFU {100 * d['mfu']:.1f}%"
        line = f"{d['scale']} {mode}: dense {d['tokens_per_s']:,.0f} tok/s{mfu}"
        if "error" in s or "skipped" in s:
            line += f", STEM {s.get('error') or s['skipped']}"
        else:
            smfu = "" if peak is None else f" MFU {100 * s['mfu']:.1f}%"
            line += (f", STEM {s['tokens_per_s']:,.0f} tok/s{smfu}, step ratio {s['step_s'] / d['step_s']:.3f} "
                     f"(FLOP ratio {s['flops_per_token'] / d['flops_per_token']:.3f})")
        parts.append(line)
    required = ctx.require_mfu is not None
    met, target = mfu_target(points, peak, ctx.require_mfu if required else TARGET_DENSE_MFU)
    if peak is None:
        target = f"MFU not measured ({source})"
    # the item passes when every point ran; the targets are printed beside the figures, enforced with --require-mfu
    if required:
        ok = ok and bool(met)
        target += " (required: --require-mfu)"
    return {"ok": ok, "figure": "; ".join(parts) + f"; {target}",
            "details": {"points": points, "peak_tflops": peak, "peak_source": source, "targets_met": met,
                        "required_dense_mfu": ctx.require_mfu}}


# ---------------------------------------------------------------------------------------------- f
def item_f(ctx: Ctx) -> dict:
    cfg = experiment(ctx.tiny)
    mcfg = model_cfg(cfg, "1b", "stem")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    torch.manual_seed(0)
    base = build_model(mcfg, "cpu").to(dtype)   # one set of weights for every configuration
    weights = ctx.work / "offload.safetensors"
    if not ctx.cuda:                 # the CPU's far tier is the safetensors file
        save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(weights))
    batches, (steps, prompt) = F_DECODE[ctx.shapes]

    def model_for(offloaded: bool, prefetch: bool = True, cache: int = 0):
        m = copy.deepcopy(base)
        if offloaded:   # far tier: pinned host memory on CUDA (from these weights), the safetensors file on the CPU
            offload(m, None if ctx.cuda else weights, ctx.device, cache_rows=cache, prefetch=prefetch)
        return m.to(ctx.device).eval()

    x, _ = _batch(mcfg.vocab_size, 2, prompt, ctx.device, seed=4)
    configs = [("resident", True, 0), ("offloaded", True, 0), ("offloaded, no prefetch", False, 0),
               ("offloaded + cache", True, 4 * mcfg.d_model)]
    logits, rates = {}, []
    for name, prefetch, cache in configs:
        m = model_for(name != "resident", prefetch, cache)
        with torch.no_grad():
            logits[name] = m(x).float()
        for b in batches:
            p, s = _batch(mcfg.vocab_size, b, prompt + steps, ctx.device, seed=5)[0].split([prompt, steps], dim=1)
            sec = decode_seconds(m, p, s)
            rates.append({"config": name, "batch": b, "tokens_per_s": b * steps / sec})
        del m
        _free(ctx)
    diff = max(float((logits[n] - logits["resident"]).abs().max()) for n in logits)
    resident = {r["batch"]: r["tokens_per_s"] for r in rates if r["config"] == "resident"}
    for r in rates:
        r["vs_resident"] = r["tokens_per_s"] / resident[r["batch"]]
    worst = min(r["vs_resident"] for r in rates if r["config"] == "offloaded")
    figure = (f"max |dlogit| offloaded vs resident {diff:.2g}; decode tok/s " + ", ".join(
        f"{r['config']} b{r['batch']} {r['tokens_per_s']:,.0f} ({r['vs_resident']:.2f}x)" for r in rates)
        + f"; worst offloaded/resident {worst:.3f} (DSE paper: < 3 % loss)")
    return {"ok": diff < 1e-3, "figure": figure, "details": {"max_abs_logit_diff": diff, "decode": rates}}


# ---------------------------------------------------------------------------------------------- g
def _eval_checkpoint(ctx: Ctx) -> Path:
    ckpt = ctx.work / "eval_checkpoint"
    docs = list(itertools.islice(web_documents(make_world(seed=3, n_countries=8, n_people=20, n_filler=100), 1), 200))
    tok = ctx.work / "tokenizer.json"
    train_bpe(docs, 300, tok)
    cfg = experiment(True)
    mcfg = model_cfg(cfg, "350m", "stem")
    torch.manual_seed(0)
    model = build_model(mcfg, "cpu")
    spec = {"experiment": "gpucheck", "scale": "350m", "variant": "stem", "stage": "pretrain", "model": mcfg.to_dict()}
    save_checkpoint(ckpt, model, spec, tok, accounting(model))
    return ckpt


def item_g(ctx: Ctx) -> dict:
    from stem.eval.lm import StemLM   # imports lm-eval (heavy): only this item needs it
    ckpt = _eval_checkpoint(ctx)
    rng = random.Random(0)
    reqs = [(None, [rng.randrange(300) for _ in range(rng.randint(8, 40))], [rng.randrange(300) for _ in range(3)])
            for _ in range(24)]
    ref = StemLM(str(ckpt), device="cpu", dtype="float32")._loglikelihood_tokens(reqs)
    dev = "cuda" if ctx.cuda else "cpu"
    fp32 = StemLM(str(ckpt), device=dev, dtype="float32")._loglikelihood_tokens(reqs)
    bf16 = StemLM(str(ckpt), device=dev, dtype="bfloat16")._loglikelihood_tokens(reqs)
    d32 = max(abs(a[0] - b[0]) for a, b in zip(fp32, ref))
    d16 = max(abs(a[0] - b[0]) for a, b in zip(bf16, ref))
    greedy = sum(a[1] == b[1] for a, b in zip(fp32, ref))
    ok = d32 <= 1e-3 and d16 <= BF16_LOGLIK_TOL and greedy == len(reqs)
    figure = (f"{len(reqs)} loglikelihood requests, {dev} vs CPU fp32: fp32 max |dll| {d32:.2g} (tol 1e-3), "
              f"bf16 {d16:.2g} (tol {BF16_LOGLIK_TOL}), greedy flags equal {greedy}/{len(reqs)}")
    return {"ok": ok, "figure": figure, "details": {"fp32_max_abs": d32, "bf16_max_abs": d16}}


ITEM_FUNCS = {"a": item_a, "b": item_b, "c": item_c, "d": item_d, "e": item_e, "f": item_f, "g": item_g}
TITLES = {"a": "bf16 training, every variant", "b": "document masks", "c": "sharded state, SIGKILL, resume",
          "d": "memory trace vs CUDA", "e": "throughput and MFU", "f": "offload on the device",
          "g": "evaluation on the device"}


# ---------------------------------------------------------------------------------------------- cost
# Fixed costs (seconds) beside the FLOPs: per model built, per compiled model (torch.compile of its blocks), per
# step or forward pass (Python, launches, the optimizer), per child process (interpreter, imports, its setup), per
# memory trace (item d, on meta tensors); set from the CPU runs of the tiny items on the 2-core development
# machine and, for CUDA, guessed (compilation of a block stack in about a minute): no GPU has run them yet.
# "compiled" on CUDA and "host_gib" (s per GiB of weights built or copied on the host) from the first H100 run:
# item e compiled three models in 56 s in all; item f spent ~130 s of 143 building and copying its 1B models.
FIXED_S = {"cuda": {"model": 3.0, "compiled": 10.0, "step": 0.05, "child": 30.0, "trace": 3.0, "host_gib": 1.2},
           "cpu": {"model": 0.1, "compiled": 12.0, "step": 0.05, "child": 8.0, "trace": 2.0, "host_gib": 1.2}}
EFFICIENCY = 0.35   # the fraction of the timed matrix product's rate a training step reaches


@dataclass
class Cost:
    """An item's predicted work: FLOPs of its steps at its shapes and the counts that carry fixed costs."""
    flops: float = 0.0
    models: int = 0
    compiled: int = 0
    steps: int = 0
    children: int = 0
    traces: int = 0
    host_gib: float = 0.0   # weights built or copied on the host (item f's configurations)

    def train(self, mcfg, seq: int, rows: int, steps: int, checkpointing: bool = False, models: int = 1):
        """``steps`` training steps of ``rows`` x ``seq`` tokens (activation checkpointing: forward twice)."""
        self.flops += _fpt(mcfg, seq) * rows * seq * steps * (4 / 3 if checkpointing else 1)
        self.steps += steps
        self.models += models

    def forward(self, mcfg, seq: int, rows: int, passes: int = 1, models: int = 0):
        self.flops += _fpt(mcfg, seq) / 3 * rows * seq * passes
        self.steps += passes
        self.models += models

    def seconds(self, rate: float, device_type: str) -> float:
        f = FIXED_S[device_type]
        return (self.flops / rate + self.models * f["model"] + self.compiled * f["compiled"] + self.steps * f["step"]
                + self.children * f["child"] + self.traces * f["trace"] + self.host_gib * f["host_gib"])

    def text(self, rate: float) -> str:
        parts = [f"{self.flops:.2g} FLOP at {rate / 1e12:.3g} TFLOP/s", f"{self.models} model(s)"]
        parts += [f"{n} {what}" for n, what in ((self.compiled, "compiled"), (self.children, "child process"),
                                                (self.traces, "memory trace")) if n]
        parts += [f"{self.host_gib:.3g} GiB copied on the host"] if self.host_gib else []
        return ", ".join(parts + [f"{self.steps} steps"])


def _fpt(mcfg, seq: int) -> float:
    return flops_per_token(accounting(build_model(mcfg, "meta")), mcfg, seq)


def matmul_rate(device: torch.device) -> float:
    """FLOP/s of a timed square matrix product (bf16 on CUDA, fp32 on the CPU) times EFFICIENCY."""
    n, dtype = (4096, torch.bfloat16) if device.type == "cuda" else (256, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    a @ a
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t, reps = time.perf_counter(), 10
    for _ in range(reps):
        a @ a
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return EFFICIENCY * 2 * n ** 3 * reps / (time.perf_counter() - t)


def predict(ctx: Ctx, key: str) -> Cost:
    """Item ``key``'s work at the shapes it runs (the same config and constants as the item)."""
    cfg, c = experiment(ctx.tiny), Cost()
    pre = cfg.stages["pretrain"]

    def mc(scale, variant, stage="pretrain"):
        return model_cfg(cfg, scale, variant, stage)
    st = pre["350m"]
    if key == "a":
        for v in ctx.variants:
            c.train(mc("350m", v), st.seq_len, min(st.micro_batch, 4), A_STEPS[ctx.shapes],
                    bool(st.activation_checkpointing))
    elif key == "b":
        c.forward(mc("350m", BASELINE), min(st.seq_len, 2048), 1, passes=3 if ctx.cuda else 2, models=1)
        c.train(mc("1b", BASELINE, "extend"), cfg.stages["extend"]["1b"].seq_len, 1, 1, checkpointing=True)
        c.compiled += ctx.cuda      # flex attention's kernel
    elif key == "c":
        world = max(1, torch.cuda.device_count()) if ctx.cuda else 1
        c.children = 1
        c.train(mc("350m", "stem"), st.seq_len, 2 * world, RESUME_STEPS)                  # the child
        c.train(mc("350m", "stem"), st.seq_len, 2, 2 * RESUME_STEPS + 2, models=2)        # reference, resume
    elif key == "d":
        c.traces = 1
        if ctx.cuda:
            c.train(mc("350m", "stem"), st.seq_len, 2 * 8, 2)
    elif key == "e":
        for scale in ("350m", "1b"):
            for compiled in (False, True) if ctx.compile else (False,):
                for v in (BASELINE, "stem"):
                    m = mc(scale, v)
                    if not _state_fits(ctx, _state_gib(accounting(build_model(m, "meta")))):
                        continue
                    micro = pre[scale].micro_batch if ctx.tiny else E_MICRO[0]
                    c.train(m, pre[scale].seq_len, micro, sum(E_REPEATS[ctx.shapes]),
                            bool(pre[scale].activation_checkpointing))
                    c.compiled += compiled
    elif key == "f":
        batches, (steps, prompt) = F_DECODE[ctx.shapes]
        m = mc("1b", "stem")
        weights_gib = (2 if ctx.cuda else 4) * accounting(build_model(m, "meta"))["total_params"] / 2**30
        c.host_gib = 9 * weights_gib   # built once, then per configuration a deep copy and a move to the device
        for _ in range(4):          # resident, offloaded, without prefetch, with a cache
            c.forward(m, prompt, 2, models=1)
            for b in batches:
                c.forward(m, prompt, b)
                c.forward(m, 1, b, passes=steps)
    elif key == "g":
        m = model_cfg(experiment(True), "350m", "stem")
        c.forward(m, 40, 24, passes=3, models=4)   # three StemLM loads score 24 requests; the checkpoint
    return c


def environment(device: torch.device) -> dict:
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "device_count": torch.cuda.device_count() if device.type == "cuda" else 0,
            "torch": torch.__version__, "cuda": torch.version.cuda}


def run(device: str = "cuda", tiny: bool = False, items: str = ITEMS, out_dir=L.GPUCHECK_DIR,
        peak_tflops: float | None = None, compile: bool = True, log=print, variants=VARIANTS,
        budget: float | None = None, require_mfu: float | None = None) -> dict:
    """Run the items, print one line each, rewrite {out_dir}/gpucheck.{json,md} after each; returns the JSON.
    With ``budget`` (seconds) the items run in VALUE_ORDER, and one whose predicted cost exceeds the time left
    is skipped (its line and entry say so)."""
    start, dev = time.perf_counter(), torch.device(device)
    if budget is not None:
        items = "".join(k for k in VALUE_ORDER if k in items)
    report = {**environment(dev), "shapes": "tiny" if tiny else "paper", "budget_s": budget, "finished": False,
              "items": {}}
    report["provenance"] = provenance.record({"device": device, "tiny": tiny, "items": items, "compile": compile,
                                              "peak_tflops": peak_tflops, "variants": list(variants),
                                              "budget": budget, "require_mfu": require_mfu})
    out = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="gpucheck_") as work:
        ctx = Ctx(dev, tiny, Path(work), peak_tflops, compile, tuple(variants), require_mfu)
        rate = matmul_rate(dev)
        for key in items:
            cost = predict(ctx, key)
            predicted = cost.seconds(rate, dev.type)
            head = f"gpucheck {key}. {TITLES[key]}"
            left = None if budget is None else budget - (time.perf_counter() - start)
            if left is not None and predicted > left:
                r = {"ok": None, "skipped": f"predicted {predicted:.0f} s, {max(left, 0):.0f} s of the {budget:.0f} s "
                                            "budget left", "figure": ""}
                log(f"{head}: SKIPPED ({r['skipped']})")
            else:
                log(f"{head}: predicted {predicted:.0f} s ({cost.text(rate)})")
                t = time.perf_counter()
                try:
                    r = ITEM_FUNCS[key](ctx)
                except Exception as e:   # one item's failure is its line; the others still run
                    r = {"ok": False, "figure": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                r["seconds"] = time.perf_counter() - t
                log(f"{head}: {'PASS' if r['ok'] else 'FAIL'} ({r['seconds']:.0f} s) {r['figure']}")
            report["items"][key] = {"title": TITLES[key], "predicted_s": predicted, **r}
            report["finished"] = key == items[-1]
            write_report(out, report)
    if not items:
        write_report(out, {**report, "finished": True})
    return report


def write_report(out: Path, report: dict):
    atomic_write_json(out / "gpucheck.json", report)
    atomic_write_text(out / "gpucheck.md", to_markdown(report))


def to_markdown(r: dict) -> str:
    label = "" if r["shapes"] == "paper" else " (tiny shapes: a check of the code paths, not paper figures)"
    budget = "" if r["budget_s"] is None else f", budget {r['budget_s']:.0f} s"
    lines = [f"# GPU check{label}", "", f"Device: {r['device']} ({r['device_count']} visible), torch {r['torch']}, "
             f"CUDA {r['cuda']}{budget}" + ("" if r["finished"] else "; unfinished (the items so far)"), "",
             "| item | check | result | predicted s | seconds | figure |", "|---|---|---|---|---|---|"]
    for k, it in r["items"].items():
        if "skipped" in it:
            lines.append(f"| {k} | {it['title']} | skipped | {it['predicted_s']:.0f} | | {it['skipped']} |")
            continue
        lines.append(f"| {k} | {it['title']} | {'pass' if it['ok'] else 'FAIL'} | {it['predicted_s']:.0f} | "
                     f"{it['seconds']:.0f} | {it['figure'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(args) -> int:
    """``python -m stem gpucheck``; exit 0 without CUDA (one line) unless ``--device cpu``/``--tiny`` asks to run."""
    device = args.device or ("cuda" if torch.cuda.is_available() else None)
    if device is None:
        print("gpucheck: no CUDA device on this machine; nothing to check (python -m stem gpucheck --tiny "
              "--device cpu runs the items' code paths at tiny shapes)")
        return 0
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available on this machine")
    bad = set(args.items) - set(ITEMS)
    if bad:
        raise ValueError(f"--items {args.items}: unknown item(s) {''.join(sorted(bad))} (expected letters of {ITEMS})")
    if args.require_mfu is not None and not 0 < args.require_mfu <= 1:
        raise ValueError(f"--require-mfu {args.require_mfu:g}: expected a fraction of the peak in (0, 1]")
    r = run(device, args.tiny, args.items, args.out, args.peak_tflops, not args.no_compile, budget=args.budget,
            require_mfu=args.require_mfu)
    failed = [k for k, it in r["items"].items() if it["ok"] is False]
    skipped = [k for k, it in r["items"].items() if "skipped" in it]
    passed = len(r["items"]) - len(failed) - len(skipped)
    print(f"gpucheck: {passed}/{len(r['items'])} passed on {r['device']}; {args.out}/gpucheck.md"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + (f"; skipped (budget): {', '.join(skipped)}" if skipped else ""))
    return 1 if failed else 0


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "resume-child":
    resume_child(sys.argv[2], sys.argv[4] == "--tiny", sys.argv[3])
