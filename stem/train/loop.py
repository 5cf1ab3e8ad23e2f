"""The training loop: reads top to bottom. One call trains one (scale, variant, stage) job spec.

``train`` = ``setup`` (process group, model, data, optimizer) -> ``resume`` (the saved state, if any) ->
``train_steps`` (the step loop: one ``stem.train.step.train_step`` a step, logging, evaluation, state) ->
``finish`` (checkpoint, metrics, summary).

Metrics (``metrics.jsonl``, one row a step): ``loss`` is the training cross-entropy (token mean over the
step); ``tokens_per_s`` (global), ``tokens_per_s_per_gpu`` and, where the GPU's peak is known, ``mfu``
(stem.train.throughput; summary.json holds their run mean); a model with auxiliary losses (the routed MoE's
load balancing) minimises ``loss + aux_loss`` and logs ``aux_loss`` beside it. Validation loss is the cross-entropy alone (the model in eval mode).

Resumable: state is saved every ``checkpoint_interval`` steps (and on SIGTERM, e.g. Slurm
preemption) under ``{out_dir}/_state``; rerunning the same spec continues from there and ends with
the same final loss as an uninterrupted run (the data loader's position is part of the state).

Distributed: under torchrun (WORLD_SIZE > 1) the same loop runs data-parallel (stem.train.distributed):
rank r keeps micro-batches r, r+W, ... of each step, so a step sees the same sequences at any world size;
the backbone is FSDP2-sharded (or replicated: the spec's ``train.parallel: ddp``), STEM/DSE tables and
Hash-MoE / routed-MoE experts are sharded over all ranks; resumable state is a DCP checkpoint that resumes at any world
size. At world size 1 every distributed helper falls through and the maths is the single-process loop's.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from stem import layout, provenance
from stem.data.loader import MixtureLoader, validation_batches
from stem.config import HF_PREFIX
from stem.data.shards import ShardSet
from stem.data.tokenizer import load_tokenizer
from stem.hf import importer as hf_import
from stem.io import atomic_write_json, atomic_write_text
from stem.models.accounting import accounting as model_accounting, flops_per_token, training_flops
from stem.models.insert import insert_stem
from stem.models.model import build_model
from stem.optim.adamw import use_row_sparse
from stem.specs import SpecError, TrainSpec
from stem import checkpoint as ck
from stem.train import comms
from stem.train import distributed
from stem.train import lifecycle
from stem.train import memory
from stem.train import optstate
from stem.train import throughput, torchfloor
from stem.train.calibration import calibrate_insertion
from stem.train.compile import compile_blocks, describe_breaks, graph_breaks
from stem.train.plan import ParallelPlan
from stem.train.schedule import get_lr
from stem.train.tables import row_shardable, to_host
from stem.train.step import TrainingError, make_optimizer, train_step


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("device 'cuda' requested but CUDA is not available (set device: cpu or auto)")
    if name == "cuda":
        torchfloor.require()   # the GPU path's PyTorch features, before anything runs (one line)
    return torch.device(name)


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


@dataclass
class Run:
    """One training job while it runs: what ``setup`` builds and the loop advances."""
    spec: TrainSpec
    ctx: distributed.DistContext
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    loader: MixtureLoader
    val: list                   # the validation batches
    autocast: object
    plan: ParallelPlan          # the job's layout over its ranks (micro-batch, accumulation, sharding)
    accounting: dict            # the model's parameter / FLOP accounting (saved with the checkpoint)
    t0: float                   # when this process started the job
    meter: throughput.Meter     # tokens/s per GPU and MFU
    comms: dict                 # the modelled communication of a step (stem.train.comms.model_step)
    import_parity: dict | None = None   # a transformers checkpoint's logits vs ours (load_init); into the summary
    insertion: dict | None = None       # init calibrated's record (stem.train.calibration); into the summary
    step: int = 0
    wall_before: float = 0.0    # wall time of the attempts before a resume
    val_loss: float = float("nan")
    loss: float = float("nan")  # the last step's training loss
    ahead: list | None = None   # the next step's batches, drawn a step ahead (``draw_ahead``)
    loader_state: dict | None = None   # the loader's state before they were drawn: what a save records

    @property
    def out_dir(self) -> Path:
        return Path(self.spec.out_dir)

    @property
    def state_dir(self) -> Path:
        return layout.state_dir(self.spec.out_dir)

    @property
    def metrics_path(self) -> Path:   # the log while running; copied to the declared metrics.jsonl at the end
        return self.state_dir / layout.METRICS

    def wall_seconds(self) -> float:
        return self.wall_before + time.time() - self.t0


def train(spec: TrainSpec | dict, threads: int | None = None, max_steps: int | None = None) -> dict:
    """Run (or resume) one training job; returns its summary. ``max_steps`` stops early (tests).

    SIGTERM/SIGURG/SIGUSR1 stop it (state saved, exit 128 + signal); a second trainer on the same ``_state``
    refuses (lifecycle)."""
    try:
        spec = TrainSpec.coerce(spec)
    except SpecError as e:
        raise TrainingError(str(e)) from None
    if spec.init_from:
        check_init_from(spec)  # before the job takes its state directory: a wrong input leaves nothing behind
    if spec.train.wandb:
        _import_wandb(spec)    # likewise: a missing package is one line before anything is written
    try:
        with lifecycle.job(layout.state_dir(spec.out_dir)) as stop:
            run = setup(spec, threads)
            resume(run)
            last = spec.train.steps if max_steps is None else min(spec.train.steps, run.step + max_steps)
            train_steps(run, stop, last)
            return finish(run) if run.step == spec.train.steps else pause(run)
    except lifecycle.StateLocked as e:
        raise TrainingError(str(e)) from None


def deterministic_algorithms(mode: bool, compiled: bool):
    """torch.use_deterministic_algorithms also sets inductor's flag, importing torch._inductor and torch._dynamo
    for it (~1.7 s of CPU per job, measured paired); a job that compiles nothing needs only the eager kernels'
    flag, which is all the public call sets besides."""
    if compiled:
        torch.use_deterministic_algorithms(mode)
    else:
        torch._C._set_deterministic_algorithms(mode)


def setup(spec: TrainSpec, threads: int | None = None) -> Run:
    """Process group, seed, model (initial weights, DSE vocabulary), its sharding, data and optimizer."""
    t0, tc = time.time(), spec.train
    ctx = distributed.setup(resolve_device(spec.device))   # joins the torchrun process group when WORLD_SIZE > 1
    if threads:
        torch.set_num_threads(max(1, threads // ctx.local_world))
    torch.manual_seed(spec.seed)
    deterministic_algorithms(ctx.device.type == "cpu", compiled=bool(tc.compile))

    model = build_model(spec.model, ctx.device)
    if spec.model.dse is not None:
        model.set_dse_vocabulary(load_tokenizer(spec.tokenizer))
    loaded = load_init(model, spec, parity=ctx.is_main) if spec.init_from else None
    parity, insertion = (None, loaded) if spec.insert is not None else (loaded, None)
    accounting = model_accounting(model)
    # the job's layout, decided once: micro-batches, strategy, the tables optim.table_update: sparse trains row-sparse
    sparse = spec.optim.row_sparse_tables(model)
    tables = row_shardable(model)
    try:
        plan = ParallelPlan.of(tc, ctx.world, row_sparse=sparse, tables=tables)
    except ValueError as e:   # a batch that does not split over the ranks, host tables on several
        raise TrainingError(f"[{spec.out_dir}] {e}") from None
    if tc.fit_gib:   # the fastest layout that fits the GPU (the workflow's gate traced this one): the same maths
        step_s = comms.fit_step_s(model, tc.seq_len, ctx.world, True, tc.host_workers,   # as memtrace.options
                                  comms.host_bandwidth(tc))
        planned, plan = plan, memory.fit(model, plan, tc.batch_size, tc.fit_gib, tables, step_s)
        first = memory.fit(model, planned, tc.batch_size, tc.fit_gib, tables)
        if ctx.is_main and (note := memory.describe_fit(planned, plan, tc.batch_size, step_s, first)):
            print(f"[{spec.out_dir}] {note}", file=sys.stderr)
    model.set_training_options(activation_checkpointing=plan.activation_checkpointing,
                               flex_attention=ctx.device.type == "cuda" and tc.cross_doc_mask)
    use_row_sparse(model, plan.row_sparse)
    to_host(model, plan.host_tables, plan.sparse_rows)   # train.tables: host
    if tc.compile:   # torchtitan's order: activation checkpointing (set above), compile each block, then FSDP
        compile_blocks(model)
    # before sharding: the model's full shapes; this process's node has local_world of the job's GPUs
    # host tables' host side at the cluster's host bandwidth (the spec's train: cluster.host_mem_gbs, at most this
    # job's cores x cluster.host_core_gbs)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    comm = comms.model_step(model, plan, tc.seq_len, ctx.local_world, ctx.device.type == "cuda", acct=accounting,
                            host_gbs=comms.host_bandwidth(tc, cores=cores), host_workers=tc.host_workers)
    if ctx.is_main:
        print(f"[{spec.out_dir}] " + memory.describe(memory.estimate(model, plan)), file=sys.stderr)
        print(f"[{spec.out_dir}] " + comms.describe(comm), file=sys.stderr)
    distributed.parallelize(model, ctx, plan)

    loader, val = _data(spec, plan.micro_batch)
    opt = make_optimizer(model, spec, plan, fused=ctx.device.type == "cuda")
    meter = throughput.Meter(flops_per_token(accounting, spec.model, tc.seq_len), ctx.world,
                             *throughput.device_peak(ctx.device, tc.peak_tflops))
    return Run(spec, ctx, model, opt, loader, val, mixed_precision(ctx.device), plan, accounting, t0, meter, comm,
               import_parity=parity, insertion=insertion)


def _data(spec: TrainSpec, micro: int) -> tuple[MixtureLoader, list]:
    """The training mixture (``micro`` sequences a micro-batch; this rank runs every world-th of them) and the
    validation batches."""
    tc = spec.train
    sources = {}
    for name, src in spec.data.items():
        manifest = Path(src.manifest)
        if not manifest.is_file():
            raise TrainingError(f"source {name!r}: token manifest {manifest} not found (run the tokenize stage)")
        sources[name] = (ShardSet(manifest.parent, "train"), src.weight)
    eos = json.loads(Path(next(iter(spec.data.values())).manifest).read_text()).get("eos_id", 0)
    loader = MixtureLoader(sources, tc.seq_len, micro, spec.seed, packed=tc.cross_doc_mask, pad_id=eos)
    val = validation_batches({n: ShardSet(s.out_dir, "val") for n, (s, _) in sources.items()},
                             tc.seq_len, tc.micro_batch, tc.eval_batches)
    return loader, val


def resume(run: Run):
    """Continue from the job's newest complete state; else start fresh (carrying init_from's optimizer state
    when the stage asks for it)."""
    spec, ctx = run.spec, run.ctx
    discard_stale_state(run)
    extra = distributed.load_state(run.state_dir, run.model, run.opt, ctx)
    if extra is None and spec.init_from and not spec.train.reset_optimizer:
        optstate.load_optimizer(Path(spec.init_from) / "optimizer", run.model, run.opt)  # carry the previous stage's
    if extra is not None:
        run.step, run.wall_before, run.val_loss = extra["step"], extra["wall_seconds"], extra["val_loss"]
        run.loader.load_state_dict(extra["loader"])
        if ctx.is_main:
            _truncate_metrics(run.metrics_path, run.step)
            print(f"[{run.out_dir}] resuming at step {run.step} (world size {ctx.world})", file=sys.stderr)
            lifecycle.event(run.state_dir, f"resumed at step {run.step} (world size {ctx.world})")
    elif run.metrics_path.exists() and ctx.is_main:
        run.metrics_path.unlink()
    run.state_dir.mkdir(parents=True, exist_ok=True)


def discard_stale_state(run: Run):
    """A state another job spec saved is not resumed: when a spec changes Snakemake reruns the job, removing its
    declared outputs but not ``_state/``, which would then continue (or, at its last step, simply end) the old
    job under the new spec. It is removed, with a line on stderr; a state that records no spec (written before
    ``spec_sha256`` was) is resumed as before. The newest readable state decides."""
    want = provenance.spec_hash(run.spec.to_dict())
    for folder in ck.state_candidates(run.state_dir):
        try:
            got = json.loads((folder / "extra.json").read_text()).get("spec_sha256")
        except (OSError, ValueError):
            continue
        if got is not None and got != want:
            if run.ctx.is_main:
                print(f"[{run.out_dir}] {run.state_dir}: saved by another job spec ({got[:12]}, this one "
                      f"{want[:12]}): starting over", file=sys.stderr)
                shutil.rmtree(run.state_dir)
            if run.ctx.world > 1:
                torch.distributed.barrier()
        return


def draw_ahead(run: Run, last: int):
    """Host tables with their update on workers (``train.host_workers``): the next step's batches drawn now (kept in
    ``run.ahead``, the loader's state before them in ``run.loader_state`` for a save), so that this step's update
    takes first the rows the next step's first micro-batch reads (``train_step``'s ``next_ids``: returned); None
    otherwise and at the last step of ``last``, so no batch is drawn beyond it."""
    run.ahead = run.loader_state = None
    if not (run.plan.host_tables and run.spec.train.host_workers) or run.step + 1 >= last:
        return None
    run.loader_state = run.loader.state_dict()
    run.ahead = [run.loader.next_batch() for _ in range(run.plan.accum)]
    return run.ahead[run.ctx.rank][0]


def train_steps(run: Run, stop: dict, last: int):
    """Steps until ``last``: one optimizer step, its metrics row, evaluation and state on their intervals. A
    stop signal ends it after the step in flight, state saved (lifecycle.Stopped)."""
    spec, tc, ctx = run.spec, run.spec.train, run.ctx
    run.model.train()
    with StepLog(run) as log:
        while run.step < last:
            t_step = time.time()
            lr = get_lr(run.step, **tc.lr_schedule())
            batches = run.ahead or [run.loader.next_batch() for _ in range(run.plan.accum)]  # every rank: the global stream
            aux = {}
            try:
                loss, grad_norm = train_step(run.model, run.opt, batches, ctx, run.autocast, lr, spec.optim.grad_clip,
                                             run.step, metrics=aux, next_ids=draw_ahead(run, last))
            except TrainingError as e:
                raise TrainingError(f"[{run.out_dir}] {e}") from None
            if aux:   # a model with auxiliary losses (routed MoE): "loss" is the cross-entropy, "aux_loss" the rest
                loss -= aux["aux_loss"]
            run.step, run.loss = run.step + 1, loss
            if tc.compile and ctx.is_main and not log.breaks_reported:   # the first step compiled every block
                log.breaks_reported = True
                print(f"[{spec.name}] {describe_breaks(graph_breaks())}", file=sys.stderr)
            tokens = run.step * tc.tokens_per_step
            tokens_per_s = tc.tokens_per_step / (time.time() - t_step)
            row = {"step": run.step, "tokens": tokens, "lr": lr, "loss": loss, **aux, "grad_norm": float(grad_norm),
                   "tokens_per_s": tokens_per_s, **run.meter.row(tokens_per_s),
                   "train_flops": training_flops(run.accounting["active_params"], tokens)}
            if run.step % tc.eval_interval == 0 or run.step == tc.steps:
                run.val_loss = evaluate(run.model, run.val, ctx.device, run.autocast) if run.val else float("nan")
                row.update(val_loss=run.val_loss, val_ppl=math.exp(min(run.val_loss, 50)))
            log.write(row)
            stopping = distributed.any_rank(ctx, stop["signal"] is not None)  # all ranks stop at the same step
            if run.step % tc.checkpoint_interval == 0 or stopping:
                save_state(run)
            if stopping:
                distributed.teardown(ctx)
                raise lifecycle.Stopped(stop["signal"] or signal.SIGTERM, run.step, ctx.world)


def save_state(run: Run):
    distributed.save_state(run.state_dir, run.step, run.model, run.opt,
                           {"loader": run.loader_state or run.loader.state_dict(), "val_loss": run.val_loss,
                            "wall_seconds": run.wall_seconds(),
                            "spec_sha256": provenance.spec_hash(run.spec.to_dict())}, run.ctx)


def pause(run: Run) -> dict:
    """Stopped early on purpose (``max_steps``): keep the state, write nothing declared."""
    save_state(run)
    distributed.teardown(run.ctx)
    return {"step": run.step, "loss": run.loss}


def finish(run: Run) -> dict:
    """The declared outputs: ``checkpoint/`` (weights, spec, tokenizer, accounting; the optimizer state when a
    later stage carries it), ``metrics.jsonl`` and ``summary.json``; returns the summary."""
    spec, ctx, out_dir = run.spec, run.ctx, run.out_dir
    if run.step == 0 and run.val:   # a stage that only imports (steps: 0): the imported model's held-out loss
        run.val_loss = evaluate(run.model, run.val, ctx.device, run.autocast)
    tokens = run.step * spec.train.tokens_per_step
    summary = {
        "experiment": spec.experiment, "scale": spec.scale, "variant": spec.variant, "stage": spec.stage,
        "final_train_loss": None, "last_step_loss": run.loss,
        "final_val_loss": run.val_loss,
        "final_val_ppl": math.exp(min(run.val_loss, 50)) if math.isfinite(run.val_loss) else None,
        "steps": run.step, "tokens": tokens, "train_flops": training_flops(run.accounting["active_params"], tokens),
        "wall_seconds": run.wall_seconds(), "device": str(ctx.device), "world_size": ctx.world,
        "tokens_by_source": run.loader.tokens_by_source, **run.accounting, "comms": run.comms,
        "runtime": torchfloor.runtime(ctx.device, next(run.model.parameters()).dtype,
                                      requested_device=spec.device,
                                      autocast="bfloat16" if ctx.device.type == "cuda" else None,
                                      compile=bool(spec.train.compile), fused_adamw=ctx.device.type == "cuda",
                                      attention="flex_attention" if
                                      ctx.device.type == "cuda" and spec.train.cross_doc_mask else "sdpa"),
    }
    if run.import_parity is not None:
        summary["import_parity"] = run.import_parity
    if run.insertion is not None:
        summary["insertion"] = run.insertion
    full = distributed.full_model_view(run.model, ctx)   # gathers the full weights to rank 0's CPU when sharded
    optim_dir = None
    if spec.train.save_optimizer:          # a later stage carries this optimizer state (reset_optimizer: false)
        optim_dir = out_dir / ".tmp_optimizer"
        if ctx.is_main:
            shutil.rmtree(optim_dir, ignore_errors=True)   # left by an attempt cut short
        if ctx.world > 1:
            torch.distributed.barrier()
        optstate.save_optimizer(optim_dir, run.model, run.opt)
    if ctx.is_main:
        summary["final_train_loss"] = _final_train_loss(run.metrics_path)
        summary.update(run.meter.summary(_rows(run.metrics_path), spec.train.tokens_per_step))
        spec_dict = spec.to_dict()   # provenance goes into the summary only, never into the job spec
        summary["provenance"] = provenance.record(spec_dict, provenance.manifests_of(spec_dict),
                                                  tokenizer=spec.tokenizer)
        ck.save_checkpoint(out_dir / layout.CHECKPOINT, full, spec_dict, spec.tokenizer, run.accounting,
                           optim_dir)
        atomic_write_text(out_dir / layout.METRICS, run.metrics_path.read_text())
        atomic_write_json(out_dir / layout.SUMMARY, summary)
    distributed.teardown(ctx)
    return summary


class StepLog:
    """Where each step's row goes: ``_state/metrics.jsonl`` and TensorBoard (rank 0), and every
    ``log_interval`` steps the progress line to the job's output and its log."""

    def __init__(self, run: Run):
        tc, self.ctx = run.spec.train, run.ctx
        self.steps, self.log_interval = tc.steps, tc.log_interval
        self.tb = _tensorboard(run.out_dir, run.step) if self.ctx.is_main and tc.tensorboard else None
        self.file = open(run.metrics_path if self.ctx.is_main else os.devnull, "a")
        self.progress = Progress(run.spec.name, run.step, tc.steps, tc.tokens_per_step, run.meter)
        self.wandb = _wandb(run) if self.ctx.is_main and tc.wandb else None
        self.breaks_reported = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()

    def write(self, row: dict):
        step = row["step"]
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in row.items():
                if key != "step":
                    self.tb.add_scalar(("val/" + key[4:]) if key.startswith("val_") else "train/" + key, value, step)
        if self.ctx.is_main and (step % self.log_interval == 0 or step == self.steps):
            line = self.progress.line(step, row["loss"], row["lr"])
            print(line, flush=True)                 # the job's output (terminal, Slurm's output file)
            print(line, file=sys.stderr, flush=True)  # and its log (logs/...)
            if self.tb is not None:
                self.tb.flush()
        if self.wandb is not None:
            self.wandb.log({("val/" + k[4:]) if k.startswith("val_") else "train/" + k: v
                            for k, v in row.items() if k != "step"}, step=step)


# what must equal between a stage and the checkpoint it starts from (the spec's model config: all but the
# context length and RoPE scaling, which context extension changes)
_STAGE_FREE_MODEL_KEYS = ("max_seq_len", "rope_scaling")
# ... and, for a mid-training insertion, what the dense source has no say in (its FFN kinds, the tables' init)
_INSERT_FREE_MODEL_KEYS = ("ffn", "table_init", "table_init_std")


def load_init(model, spec: TrainSpec, parity: bool = False) -> dict | None:
    """The stage's initial weights: the previous stage's checkpoint, or a transformers checkpoint (``hf:``). With
    ``parity`` (the main rank), a transformers checkpoint loaded as it is (no insertion) is checked: the returned
    import parity is the max |logit difference| against transformers' own forward on the first held-out window
    (up to 256 tokens) of the stage's data (``stem.hf.importer.ids_parity``); an insertion returns init
    ``calibrated``'s record (``_insert``); else None."""
    if spec.init_from.startswith(HF_PREFIX):
        src = spec.init_from[len(HF_PREFIX):]
        ids = _parity_ids(spec) if parity and spec.insert is None else None
        try:
            state, hf_model = hf_import.load_for_stage(src, spec.model, hf_import.log_stderr, keep_hf=ids is not None)
            if spec.insert is not None:   # the official insertion path: a published dense model into STEM
                return _insert(model, state, spec, src)
            else:
                hf_import.load_into(model, state, src)
        except ValueError as e:
            raise TrainingError(f"init_from {spec.init_from}: {e}") from None
        if ids is None:
            return None
        out = {"source": src, **hf_import.ids_parity(model, hf_model, ids)}
        model.train()
        print(f"[{spec.out_dir}] import parity vs transformers on {out['tokens']} held-out tokens: max |logit diff| "
              f"{out['max_abs_logit_diff']:.2e} (max |logit| {out['max_abs_logit']:.1f}), argmax agreement "
              f"{out['argmax_agreement']:.3f}", file=sys.stderr)
        return out
    if spec.insert is not None:   # mid-training insertion: a dense checkpoint into this STEM model
        where = str(Path(spec.init_from) / "model.safetensors")
        try:
            return _insert(model, ck.read_weights(where), spec, f"{spec.insert['from']} ({where})")
        except ValueError as e:
            raise TrainingError(str(e)) from None
    ck.load_weights(model, Path(spec.init_from) / "model.safetensors")
    return None


def _insert(model, state: dict, spec: TrainSpec, where: str) -> dict | None:
    """STEM inserted into ``model`` from the dense weights ``state`` by ``spec.insert``'s init; ``calibrated``
    first calibrates the tables on the calibration source (stem.train.calibration): its record is returned (the
    summary's ``insertion``), else None."""
    init, calib, rec = spec.insert["init"], None, None
    if init == "calibrated":
        log = lambda line: print(f"[{spec.out_dir}] {line}", file=sys.stderr)   # noqa: E731
        calib, rec = calibrate_insertion(model.cfg, state, spec.insert["calibration"],
                                         next(iter(spec.data.values())).manifest, spec.train.seq_len, log)
    layers = insert_stem(model, state, init, where, calib)
    print(f"[{spec.out_dir}] STEM inserted into {where}: tables of layers {layers} initialised {init}, their "
          f"up-projections dropped", file=sys.stderr)
    return rec


def _parity_ids(spec: TrainSpec) -> torch.Tensor | None:
    """The first held-out window (up to 256 tokens) of the stage's first source, (1, T); None without one."""
    manifest = Path(next(iter(spec.data.values())).manifest)
    if not manifest.is_file():
        return None
    val = validation_batches({"first": ShardSet(manifest.parent, "val")}, min(256, spec.train.seq_len), 1, 1)
    return val[0][0] if val else None


def check_init_from(spec: TrainSpec):
    """The init_from checkpoint is the expected experiment/scale/variant and previous stage, with the same
    architecture; else one TrainingError line naming its config.json and the mismatch. A transformers checkpoint
    (``hf:``) has the stage's shapes (stem.hf.importer.check_arch)."""
    if spec.init_from.startswith(HF_PREFIX):
        try:   # a GGUF file's shapes are checked when it is read (load_for_stage): reading it is the cost
            source, gguf_file = hf_import.split_source(spec.init_from[len(HF_PREFIX):])
            folder = hf_import.resolve(source)
            if gguf_file:
                hf_import.check_gguf(folder, gguf_file)
            else:
                hf_import.check_arch(hf_import.model_config(folder)[0], spec.model, folder / "config.json")
        except ValueError as e:
            raise TrainingError(f"init_from {spec.init_from}: {e}") from None
        return
    ckpt = Path(spec.init_from)
    try:
        saved = ck.read_checkpoint_spec(ckpt)
    except ValueError as e:
        raise TrainingError(f"init_from: {e}") from None
    where = ckpt / "config.json"
    want = {"experiment": spec.experiment, "scale": spec.scale,
            "variant": spec.insert["from"] if spec.insert else spec.variant, "stage": spec.init_stage}
    for key, value in want.items():
        if value is not None and saved.get(key) != value:
            raise TrainingError(f"{where}: init_from checkpoint has {key} {saved.get(key)!r}, expected {value!r} "
                                f"(a {spec.stage} job starts from {want})")
    model = {k: v for k, v in spec.to_dict()["model"].items() if k not in _STAGE_FREE_MODEL_KEYS
             and not (spec.insert and k in _INSERT_FREE_MODEL_KEYS)}
    for key, value in model.items():
        if saved["model"].get(key) != value:
            raise TrainingError(f"{where}: init_from checkpoint has model.{key} {saved['model'].get(key)!r}, "
                                f"expected {value!r}")


class Progress:
    """The progress line printed every log_interval: step/total, loss, LR, tokens/s over the interval (with
    ``meter``: per GPU under data parallelism, and MFU where the peak is known) and the ETA at the throughput
    since this process started (a resumed job counts from its resume step)."""

    def __init__(self, name: str, step: int, total: int, tokens_per_step: int, meter: throughput.Meter | None = None):
        self.name, self.total, self.tokens_per_step, self.meter = name, total, tokens_per_step, meter
        self.start_step, self.start = step, time.time()
        self.last_step, self.last = step, self.start

    def line(self, step: int, loss: float, lr: float) -> str:
        now = time.time()
        tok_s = (step - self.last_step) * self.tokens_per_step / max(now - self.last, 1e-9)
        eta = (self.total - step) * (now - self.start) / max(step - self.start_step, 1)
        self.last_step, self.last = step, now
        return (f"[{self.name}] step {step}/{self.total} ({100 * step / self.total:.0f}%) loss {loss:.4f} "
                f"lr {lr:.2e} {tok_s:,.0f} tok/s{self.meter.line(tok_s) if self.meter else ''} ETA {_hms(eta)}")


def _hms(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def _tensorboard(out_dir: Path, step: int):
    """A TensorBoard writer for {out_dir}/tensorboard; events from a step after ``step`` (left by a run cut
    after its last saved state) are purged on resume, so the curves show each step once."""
    try:
        from torch.utils.tensorboard import SummaryWriter   # optional: only with train.tensorboard: true
    except ImportError:
        raise TrainingError("train.tensorboard: true needs the tensorboard package (pip install tensorboard)") from None
    folder = out_dir / layout.TENSORBOARD
    if folder.exists() and not folder.is_dir():
        raise TrainingError(f"{folder}: a file, not a folder (train.tensorboard: true writes its event files in this "
                            "folder); expected a folder or nothing there: move the file away")
    if step == 0:   # a fresh start: no curves of an earlier attempt
        shutil.rmtree(folder, ignore_errors=True)
    try:
        return SummaryWriter(str(folder), purge_step=step + 1 if step else None)
    except OSError as e:   # a parent that is a file, no permission, a full disk
        raise TrainingError(f"{folder}: cannot create the TensorBoard folder ({e.strerror or e}); expected a "
                            "writable folder (train.tensorboard: true)") from None


def _import_wandb(spec: TrainSpec):
    try:
        import wandb   # optional and heavy: only a job that names a project imports it
    except ImportError:
        raise TrainingError(f"train.wandb: {spec.train.wandb!r} needs the wandb package (pip install wandb), "
                            "or leave train.wandb out") from None
    return wandb


def _wandb(run: Run):
    """A Weights & Biases run in ``train.wandb``'s project named by the job's folder (WANDB_MODE=offline
    works without a network)."""
    return _import_wandb(run.spec).init(project=run.spec.train.wandb, name=run.spec.out_dir, config=run.spec.to_dict(),
                      dir=str(run.state_dir), id=hashlib.sha1(run.spec.out_dir.encode()).hexdigest()[:16],
                      resume="allow")   # a resumed job continues its W&B run


def _rows(metrics_path: Path) -> list[dict]:
    return [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]


def _final_train_loss(metrics_path: Path, last: int = 10) -> float:
    """Mean training loss of the last ``last`` steps (one step's loss is noisy at small batch sizes); None
    without a step."""
    rows = _rows(metrics_path)
    tail = [r["loss"] for r in rows[-last:]]
    return sum(tail) / len(tail) if tail else None   # None: no step (a stage that only imports)


def _truncate_metrics(path: Path, step: int):
    if path.exists():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        atomic_write_text(path, "".join(line + "\n" for line in keep))
