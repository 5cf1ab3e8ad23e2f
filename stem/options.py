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


class InsertInit(StrEnum):
    """A mid-training insertion's table init (stem.models.insert)."""
    PROJECTED = "projected"
    RAW = "raw"
    XAVIER = "xavier"


def values(option: type[StrEnum]) -> tuple[str, ...]:
    return tuple(m.value for m in option)
