"""The training loop: reads top to bottom. One call trains one (scale, variant, stage) job spec.

Resumable: state is saved every ``checkpoint_interval`` steps (and on SIGTERM, e.g. Slurm
preemption) under ``{out_dir}/_state``; rerunning the same spec continues from there and ends with
the same final loss as an uninterrupted run (the data loader's position is part of the state).

Distributed: under torchrun (WORLD_SIZE > 1) the same loop runs data-parallel (stem.train.distributed):
rank r keeps micro-batches r, r+W, ... of each step, so a step sees the same sequences at any world size;
the backbone is FSDP2-sharded (or replicated, ``STEM_PARALLEL=ddp``), STEM/DSE tables and Hash-MoE
experts are sharded over all ranks; resumable state is a DCP checkpoint that resumes at any world size.
At world size 1 every distributed helper falls through and the maths is the single-process loop's.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from stem.data.loader import MixtureLoader, validation_batches
from stem.data.shards import ShardSet
from stem.models.accounting import accounting as model_accounting, training_flops
from stem.models.model import build_model
from stem.models.config import ModelConfig
from stem.train import checkpoint as ck
from stem.io import atomic_write_json, atomic_write_text
from stem.train.checkpoint import load_weights, save_checkpoint
from stem.train import distributed
from stem.train import lifecycle
from stem.train import memory
from stem.train.optim import build_optimizer, configure_table_update, set_lr
from stem.train.schedule import get_lr


class TrainingError(RuntimeError):
    pass


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("device 'cuda' requested but CUDA is not available (set device: cpu or auto)")
    return torch.device(name)


def _open_sources(spec: dict, split: str) -> dict[str, tuple[ShardSet, float]]:
    out = {}
    for name, src in spec["data"].items():
        manifest = Path(src["manifest"])
        if not manifest.is_file():
            raise TrainingError(f"source {name!r}: token manifest {manifest} not found (run the tokenize stage)")
        out[name] = (ShardSet(manifest.parent, split), src["weight"])
    return out


def mixed_precision(device: torch.device, enabled: bool | None = None):
    """The loop's autocast: bf16 on CUDA, off elsewhere; ``enabled=True`` turns it on anywhere (tests, CPU)."""
    on = device.type == "cuda" if enabled is None else enabled
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


@torch.no_grad()
def evaluate(model, batches, device, autocast) -> float:
    model.eval()
    losses = []
    for x, y in batches:
        with autocast:
            losses.append(model(x.to(device), y.to(device)).item())
    model.train()
    return sum(losses) / max(1, len(losses))


def accumulate_gradients(model, batches, ctx, device, autocast, step: int = 0) -> float:
    """Forward and backward over one optimizer step's micro-batches; returns the step's training loss.

    ``batches`` is the whole step's list (every rank's); this rank runs micro-batches rank, rank+W, ...
    The objective is the token mean of the whole step: the sum of the losses of every trained target
    (target != -1) in all micro-batches on all ranks, divided by their total count, so the gradient does
    not depend on how the batch is split (packed rows carry different numbers of targets). Each
    micro-batch's mean loss is weighted by count_i / total; FSDP (or the DDP sync) then averages over
    the W ranks, hence the extra factor W. The count comes from the batches themselves, which every rank
    holds, so no collective is needed before backward. Under FSDP every backward reduce-scatters its
    gradients, so they stay sharded between micro-batches (stem.train.memory traces that peak)."""
    counts = [int((y != -1).sum()) for _, y, _ in batches]
    total = sum(counts)
    if total == 0:
        raise TrainingError(f"step {step}: no trained targets in the whole batch (every target is padding)")
    loss_sum = 0.0
    for i in range(ctx.rank, len(batches), ctx.world):
        x, y, pos = batches[i]
        x, y, pos = x.to(device), y.to(device), None if pos is None else pos.to(device)
        if counts[i] == 0:  # nothing to learn here, but FSDP expects the same forward/backward on every rank
            with autocast:
                (model(x, positions=pos).float().sum() * 0.0).backward()
            continue
        divisor = total / (counts[i] * ctx.world)  # == accum / W when every micro-batch has the same count
        with autocast:
            loss = model(x, y, positions=pos)
        (loss / divisor).backward()
        loss_sum += loss.item() / divisor
    return distributed.all_mean(ctx, loss_sum)


def train(spec: dict, threads: int | None = None, max_steps: int | None = None) -> dict:
    """Run (or resume) one training job; returns its summary. ``max_steps`` stops early (tests).

    SIGTERM/SIGUSR1 stop it (state saved); a second trainer on the same ``_state`` refuses (lifecycle)."""
    if spec.get("init_from"):
        check_init_from(spec)  # before the job takes its state directory: a wrong input leaves nothing behind
    try:
        with lifecycle.job(Path(spec["out_dir"]) / "_state") as stop:
            return _train(spec, stop, threads, max_steps)
    except lifecycle.StateLocked as e:
        raise TrainingError(str(e)) from None


def _train(spec: dict, stop: dict, threads: int | None, max_steps: int | None) -> dict:
    t0 = time.time()
    tc, out_dir = spec["train"], Path(spec["out_dir"])
    state_dir = out_dir / "_state"
    ctx = distributed.setup(resolve_device(spec["device"]))   # joins the torchrun process group when WORLD_SIZE > 1
    device, strategy = ctx.device, os.environ.get("STEM_PARALLEL", tc.get("parallel", "fsdp"))
    if threads:
        torch.set_num_threads(max(1, threads // ctx.local_world))
    torch.manual_seed(spec["seed"])
    torch.use_deterministic_algorithms(device.type == "cpu")

    # ---- model, tokenizer-dependent buffers, initial weights
    cfg = ModelConfig.from_dict(spec["model"])
    model = build_model(cfg, device)
    if cfg.dse is not None:
        from stem.data.tokenizer import load_tokenizer
        from stem.models.dse import compression_map
        tok = load_tokenizer(spec["tokenizer"])
        texts = [tok.decode([i]) for i in range(min(tok.vocab_size, cfg.vocab_size))]
        texts += [f"<unused{i}>" for i in range(len(texts), cfg.vocab_size)]
        model.dse_compress.copy_(compression_map(texts).to(device))
    if spec.get("init_from"):
        load_weights(model, Path(spec["init_from"]) / "model.safetensors")
    accounting = model_accounting(model)
    model.activation_checkpointing = bool(tc.get("activation_checkpointing", False))
    if device.type == "cuda" and tc.get("cross_doc_mask"):
        from stem.models.attention import flex_document_mask
        model.flex_mask_fn = flex_document_mask
    micro, accum = distributed.local_micro_batch(tc["batch_size"], tc["micro_batch"], ctx.world)
    configure_table_update(model, spec["optim"])   # optim.table_update: sparse -> row-sparse table gradients
    if ctx.is_main:
        print(f"[{out_dir}] " + memory.describe(memory.estimate(
            model, micro, tc["seq_len"], ctx.world, strategy, model.activation_checkpointing)), file=sys.stderr)
    distributed.parallelize(model, ctx, strategy)
    autocast = mixed_precision(device)

    # ---- data and optimizer
    # accum micro-batches of `micro` sequences per step in all; this rank runs every world-th of them
    sources = _open_sources(spec, "train")
    eos = json.loads(Path(next(iter(spec["data"].values()))["manifest"]).read_text()).get("eos_id", 0)
    loader = MixtureLoader(sources, tc["seq_len"], micro, spec["seed"],
                           packed=tc.get("cross_doc_mask", False), pad_id=eos)
    val = validation_batches({n: ShardSet(s.out_dir, "val") for n, (s, _) in sources.items()},
                             tc["seq_len"], tc["micro_batch"], tc["eval_batches"])
    opt = build_optimizer(model, spec["optim"], tc["lr"], fused=device.type == "cuda")
    distributed.optimizer_for_dtensors(opt, ctx, strategy)
    lr_kw = {k: tc[k] for k in ("lr", "steps", "warmup", "schedule", "min_lr_ratio")}
    lr_kw["schedule_steps"] = tc.get("schedule_steps")

    # ---- resume
    step, wall_before, val_loss = 0, 0.0, float("nan")
    extra = distributed.load_state(state_dir, model, opt, ctx)
    if extra is None and spec.get("init_from") and not tc.get("reset_optimizer", True):
        ck.load_optimizer(Path(spec["init_from"]) / "optimizer", model, opt)  # carry the previous stage's state
    metrics_path = state_dir / "metrics.jsonl"
    if extra is not None:
        step, wall_before, val_loss = extra["step"], extra["wall_seconds"], extra["val_loss"]
        loader.load_state_dict(extra["loader"])
        if ctx.is_main:
            _truncate_metrics(metrics_path, step)
            print(f"[{out_dir}] resuming at step {step} (world size {ctx.world})", file=sys.stderr)
            _event(state_dir, f"resumed at step {step} (world size {ctx.world})")
    elif metrics_path.exists() and ctx.is_main:
        metrics_path.unlink()
    state_dir.mkdir(parents=True, exist_ok=True)

    tokens_per_step = tc["batch_size"] * tc["seq_len"]
    last = step + (max_steps if max_steps is not None else tc["steps"])
    loss_value = float("nan")
    model.train()

    def snapshot():
        distributed.save_state(state_dir, step, model, opt, {"loader": loader.state_dict(), "val_loss": val_loss,
                                                   "wall_seconds": wall_before + time.time() - t0}, ctx)

    tb = _tensorboard(out_dir, step) if ctx.is_main and tc.get("tensorboard") else None
    progress = Progress(f"{spec['scale']}/{spec['variant']}/{spec['stage']}", step, tc["steps"], tokens_per_step)
    with open(metrics_path if ctx.is_main else os.devnull, "a") as log, (tb or nullcontext()):
        while step < min(tc["steps"], last):
            t_step = time.time()
            lr = get_lr(step, **lr_kw)
            set_lr(opt, lr)
            batches = [loader.next_batch() for _ in range(accum)]  # every rank draws the global stream
            loss_sum = accumulate_gradients(model, batches, ctx, device, autocast, step)
            if not math.isfinite(loss_sum):
                raise TrainingError(f"[{out_dir}] non-finite training loss {loss_sum} at step {step} (lr={lr:.3g})")
            distributed.sync_replicated_grads(model, ctx)
            grad_norm = distributed.clip_grad_norm_(model, spec["optim"]["grad_clip"] or float("inf"), ctx)
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            loss_value = loss_sum
            dt = time.time() - t_step
            row = {"step": step, "tokens": step * tokens_per_step, "lr": lr, "loss": loss_sum,
                   "grad_norm": float(grad_norm), "tokens_per_s": tokens_per_step / dt,
                   "train_flops": training_flops(accounting["active_params"], step * tokens_per_step)}
            if step % tc["eval_interval"] == 0 or step == tc["steps"]:
                val_loss = evaluate(model, val, device, autocast) if val else float("nan")
                row.update(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 50)))
            log.write(json.dumps(row) + "\n")
            log.flush()
            if tb is not None:
                for key, value in row.items():
                    if key != "step":
                        tb.add_scalar(("val/" + key[4:]) if key.startswith("val_") else "train/" + key, value, step)
            if ctx.is_main and (step % tc["log_interval"] == 0 or step == tc["steps"]):
                line = progress.line(step, loss_sum, lr)
                print(line, flush=True)                 # the job's output (terminal, Slurm's output file)
                print(line, file=sys.stderr, flush=True)  # and its log (logs/...)
                if tb is not None:
                    tb.flush()
            stopping = distributed.any_rank(ctx, stop["signal"] is not None)  # all ranks stop at the same step
            if step % tc["checkpoint_interval"] == 0 or stopping:
                snapshot()
            if stopping:
                sig = stop["signal"] or signal.SIGTERM
                print(f"[{out_dir}] stopped by signal {sig} at step {step}; state saved", file=sys.stderr)
                if ctx.is_main:
                    _event(state_dir, f"stopped by signal {sig} at step {step}; state saved (world size {ctx.world})")
                distributed.teardown(ctx)
                raise SystemExit(128 + sig)

    if step < tc["steps"]:  # stopped early on purpose (max_steps): keep the state, write nothing declared
        snapshot()
        distributed.teardown(ctx)
        return {"step": step, "loss": loss_value}

    wall = wall_before + time.time() - t0
    summary = {
        "experiment": spec["experiment"], "scale": spec["scale"], "variant": spec["variant"], "stage": spec["stage"],
        "final_train_loss": None, "last_step_loss": loss_value,
        "final_val_loss": val_loss, "final_val_ppl": math.exp(min(val_loss, 50)) if math.isfinite(val_loss) else None,
        "steps": step, "tokens": step * tokens_per_step,
        "train_flops": training_flops(accounting["active_params"], step * tokens_per_step),
        "wall_seconds": wall, "device": str(device), "world_size": ctx.world,
        "tokens_by_source": loader.tokens_by_source, **accounting,
    }
    full = distributed.full_model_view(model, ctx)   # gathers the full weights to rank 0's CPU when sharded
    optim_dir = None
    if tc.get("save_optimizer"):           # a later stage carries this optimizer state (reset_optimizer: false)
        optim_dir = out_dir / ".tmp_optimizer"
        if ctx.is_main:
            shutil.rmtree(optim_dir, ignore_errors=True)   # left by an attempt cut short
        if ctx.world > 1:
            torch.distributed.barrier()
        ck.save_optimizer(optim_dir, model, opt)
    if ctx.is_main:
        summary["final_train_loss"] = _final_train_loss(metrics_path)
        save_checkpoint(out_dir / "checkpoint", full, spec, spec["tokenizer"], accounting, optim_dir)
        atomic_write_text(out_dir / "metrics.jsonl", metrics_path.read_text())
        atomic_write_json(out_dir / "summary.json", summary)
    distributed.teardown(ctx)
    return summary


# what must equal between a stage and the checkpoint it starts from (the spec's model config: all but the
# context length and RoPE scaling, which context extension changes)
_STAGE_FREE_MODEL_KEYS = ("max_seq_len", "rope_scaling")


def check_init_from(spec: dict):
    """The init_from checkpoint is the expected experiment/scale/variant and previous stage, with the same
    architecture; else one TrainingError line naming its config.json and the mismatch."""
    ckpt = Path(spec["init_from"])
    try:
        saved = ck.read_checkpoint_spec(ckpt)
    except ValueError as e:
        raise TrainingError(f"init_from: {e}") from None
    where = ckpt / "config.json"
    want = {"experiment": spec["experiment"], "scale": spec["scale"], "variant": spec["variant"],
            "stage": spec.get("init_stage")}
    for key, value in want.items():
        if value is not None and saved.get(key) != value:
            raise TrainingError(f"{where}: init_from checkpoint has {key} {saved.get(key)!r}, expected {value!r} "
                                f"(a {spec['stage']} job starts from {want})")
    model = {k: v for k, v in spec["model"].items() if k not in _STAGE_FREE_MODEL_KEYS}
    for key, value in model.items():
        if saved["model"].get(key) != value:
            raise TrainingError(f"{where}: init_from checkpoint has model.{key} {saved['model'].get(key)!r}, "
                                f"expected {value!r}")


class Progress:
    """The progress line printed every log_interval: step/total, loss, LR, tokens/s over the interval and
    the ETA at the throughput since this process started (a resumed job counts from its resume step)."""

    def __init__(self, name: str, step: int, total: int, tokens_per_step: int):
        self.name, self.total, self.tokens_per_step = name, total, tokens_per_step
        self.start_step, self.start = step, time.time()
        self.last_step, self.last = step, self.start

    def line(self, step: int, loss: float, lr: float) -> str:
        now = time.time()
        tok_s = (step - self.last_step) * self.tokens_per_step / max(now - self.last, 1e-9)
        eta = (self.total - step) * (now - self.start) / max(step - self.start_step, 1)
        self.last_step, self.last = step, now
        return (f"[{self.name}] step {step}/{self.total} ({100 * step / self.total:.0f}%) loss {loss:.4f} "
                f"lr {lr:.2e} {tok_s:,.0f} tok/s ETA {_hms(eta)}")


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _tensorboard(out_dir: Path, step: int):
    """A TensorBoard writer for {out_dir}/tensorboard; events from a step after ``step`` (left by a run cut
    after its last saved state) are purged on resume, so the curves show each step once."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise TrainingError("train.tensorboard: true needs the tensorboard package (pip install tensorboard)") from None
    if step == 0:   # a fresh start: no curves of an earlier attempt
        shutil.rmtree(out_dir / "tensorboard", ignore_errors=True)
    return SummaryWriter(str(out_dir / "tensorboard"), purge_step=step + 1 if step else None)


def _event(state_dir: Path, text: str):
    """One line in {out_dir}/_state/events.log: the stop/resume history survives Snakemake's retries."""
    with open(state_dir / "events.log", "a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")


def _final_train_loss(metrics_path: Path, last: int = 10) -> float:
    """Mean training loss of the last ``last`` steps (one step's loss is noisy at small batch sizes)."""
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    tail = [r["loss"] for r in rows[-last:]]
    return sum(tail) / len(tail)


def _truncate_metrics(path: Path, step: int):
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        atomic_write_text(path, "".join(line + "\n" for line in keep))
