"""One optimizer step, shared by the training loop (stem.train.loop) and the memory trace (stem.train.memtrace):
the optimizer as a job builds it, then forward/backward over the step's micro-batches, gradient sync and
clipping, and the update."""
from __future__ import annotations

import math

from stem.optim.adamw import set_lr
from stem.train import distributed
from stem.train.plan import ParallelPlan
from stem.train.tables import first_reads, prefetch, send_rows


class TrainingError(RuntimeError):
    pass


def make_optimizer(model, spec, plan: ParallelPlan, fused: bool):
    """The job's AdamW over the model's parameter groups (``spec``: a TrainSpec; ``OptimSpec.build``), ready
    for the sharding ``plan`` gave the model; host tables' updates on ``train.host_workers`` threads if set."""
    opt = distributed.optimizer_for_dtensors(spec.optim.build(model, spec.train.lr, fused=fused), plan)
    if plan.host_tables and spec.train.host_workers and hasattr(opt, "overlap"):   # not the memory trace's AdamW
        opt.overlap(spec.train.host_workers)
    return opt


def accumulate_gradients(model, batches, ctx, device, autocast, step: int = 0, counts=None, on_backward=None,
                         metrics: dict | None = None) -> float:
    """Forward and backward over one optimizer step's micro-batches; returns the step's training loss (the
    objective: cross-entropy plus, for a model with auxiliary losses such as the routed MoE's balance loss,
    those; ``metrics``, if given, receives their part as ``aux_loss``, weighted and averaged like the loss).

    ``batches`` is the whole step's list (every rank's); this rank runs micro-batches rank, rank+W, ...
    The objective is the token mean of the whole step: the sum of the losses of every trained target
    (target != -1) in all micro-batches on all ranks, divided by their total count, so the gradient does
    not depend on how the batch is split (packed rows carry different numbers of targets). Each
    micro-batch's mean loss is weighted by count_i / total; FSDP (or the DDP sync) then averages over
    the W ranks, hence the extra factor W. The count comes from the batches themselves, which every rank
    holds, so no collective is needed before backward (``counts`` gives them instead: the memory trace's
    fake tensors hold no values). Under FSDP every backward reduce-scatters its gradients, so they stay
    sharded between micro-batches (stem.train.memtrace traces that peak). Host tables fetch the next
    micro-batch's rows between this one's forward and backward (``stem.train.tables.prefetch``) and send their step's
    gradient rows to the host during the last backward (``send_rows``).
    ``on_backward()`` runs after each micro-batch's backward (the memory tracker's bookkeeping)."""
    counts = [int((y != -1).sum()) for _, y, _ in batches] if counts is None else counts
    total = sum(counts)
    if total == 0:
        raise TrainingError(f"step {step}: no trained targets in the whole batch (every target is padding)")
    loss_sum = aux_sum = 0.0
    mine = range(ctx.rank, len(batches), ctx.world)
    ahead = _to(batches[mine[0]], device)
    for k, i in enumerate(mine):
        (x, y, pos), ahead = ahead, _to(batches[mine[k + 1]], device) if k + 1 < len(mine) else None
        if counts[i] == 0:  # nothing to learn here, but FSDP expects the same forward/backward on every rank
            with autocast:
                out = model(x, positions=pos).float().sum() * 0.0
            _prefetch(model, ahead)
            out.backward()
        else:
            divisor = total / (counts[i] * ctx.world)  # == accum / W when every micro-batch has the same count
            with autocast:
                loss = model(x, y, positions=pos)
            _prefetch(model, ahead)
            (loss / divisor).backward()
            loss_sum += loss.item() / divisor
            aux = getattr(model, "aux_loss", None)   # the forward's auxiliary losses (stem.models.model)
            if aux is not None:
                aux_sum += aux.item() / divisor
        if on_backward is not None:
            on_backward()
    if metrics is not None and getattr(model, "aux_modules", None):   # the model's structure: the same on every rank
        metrics["aux_loss"] = distributed.all_mean(ctx, aux_sum)
    return distributed.all_mean(ctx, loss_sum)


def _to(batch, device) -> tuple:
    x, y, pos = batch
    return x.to(device), y.to(device), None if pos is None else pos.to(device)


def _prefetch(model, ahead):
    """Host tables (``train.tables: host``): the next micro-batch's rows, fetched while this one's backward runs; before
    the step's last backward, each table's rows sent to the host as soon as that backward has added them
    (``send_rows``)."""
    if ahead is not None:
        prefetch(model, ahead[0])
    else:
        send_rows(model)


def train_step(model, opt, batches, ctx, autocast, lr: float, grad_clip: float | None, step: int = 0,
               counts=None, on_backward=None, metrics: dict | None = None, next_ids=None):
    """One optimizer step at learning rate ``lr``: gradients of the step's token-mean loss (above), averaged
    over replicas and clipped to ``grad_clip`` (global L2 norm; None: no clipping), then the update.
    Returns (training loss, gradient norm before clipping); ``metrics``: as ``accumulate_gradients``.
    ``next_ids``: the token ids of this rank's first micro-batch of the next step, if drawn: host tables' update on
    workers (``train.host_workers``) takes the rows it reads first (``RowSparseAdamW.read_first``)."""
    set_lr(opt, lr)
    loss = accumulate_gradients(model, batches, ctx, ctx.device, autocast, step, counts, on_backward, metrics)
    if not math.isfinite(loss):
        raise TrainingError(f"non-finite training loss {loss} at step {step} (lr={lr:.3g})")
    distributed.sync_replicated_grads(model, ctx)
    grad_norm = distributed.clip_grad_norm_(model, grad_clip or float("inf"), ctx)
    if next_ids is not None and hasattr(opt, "read_first"):
        opt.read_first(first_reads(model, next_ids))
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss, grad_norm
