"""The project's option lists, each defined once (``StrEnum``: a member is its string, so specs, JSON and
comparisons with plain strings are unchanged). ``config/schema.yaml`` repeats them for the workflow's schema
validation; ``tests/test_options.py`` checks every such enum against the one here."""
from __future__ import annotations

from enum import StrEnum


class Experiment(StrEnum):
    """The experiments shipped as config/{name}.yaml."""
    TINY = "tiny"
    PAPER = "paper"
    REHEARSAL = "rehearsal"


class Scale(StrEnum):
    S350M = "350m"
    S1B = "1b"


class Stage(StrEnum):
    PRETRAIN = "pretrain"
    MIDTRAIN = "midtrain"
    EXTEND = "extend"


class Strategy(StrEnum):
    """The backbone's parallel strategy under torchrun (stem.train.distributed)."""
    FSDP = "fsdp"
    DDP = "ddp"


class TableLayout(StrEnum):
    """Where a job keeps its lookup tables (stem.train.distributed, stem.train.tables): each its own FSDP unit,
    row-sharded with only the looked-up rows moved, or (one rank) in host memory."""
    FSDP = "fsdp"
    ROWS = "rows"
    HOST = "host"


class Schedule(StrEnum):
    COSINE = "cosine"
    LINEAR = "linear"
    CONSTANT = "constant"


class TableUpdate(StrEnum):
    """How AdamW updates the STEM tables (stem.optim.adamw): every row, or the batch's rows only."""
    DENSE = "dense"
    SPARSE = "sparse"


class TableInit(StrEnum):
    XAVIER_NORMAL = "xavier_normal"
    NORMAL = "normal"


class Truncation(StrEnum):
    """What an eval request longer than the model's context keeps (stem.eval.lm.truncate; a suite's
    ``truncation:``): refuse it, its last tokens (lm-eval's own models), or its first and last halves
    (LongBench's pred.py)."""
    ERROR = "error"
    LEFT = "left"
    MIDDLE = "middle"


class InsertInit(StrEnum):
    """A mid-training insertion's table init (stem.models.insert): U = RMSNorm(E) W_up^T, E W_up^T (the
    official script before RMSNorm), or the table's own."""
    PROJECTED = "projected"
    RAW = "raw"
    XAVIER = "xavier"


def values(option: type[StrEnum]) -> tuple[str, ...]:
    return tuple(m.value for m in option)
