"""The project's option lists, each defined once (``StrEnum``: a member is its string, so specs, JSON and
comparisons with plain strings are unchanged). The experiment config's typed tree (``stem.config.experiment``) types its
fields with them; ``tests/test_options.py`` checks that no option list is written as a literal there."""
from __future__ import annotations

from enum import StrEnum


class Experiment(StrEnum):
    """The experiments shipped as config/{name}.yaml."""
    TINY = "tiny"
    PAPER = "paper"
    REHEARSAL = "rehearsal"
    REAL = "real"
    KNOWLEDGE = "knowledge"


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
    official script before RMSNorm), the table's own, or calibrated from the dense model's activations on
    calibration text (stem.models.calibrate; trained: stem.train.calibration, step 0: analysis ``insertion_step0``)."""
    PROJECTED = "projected"
    RAW = "raw"
    XAVIER = "xavier"
    CALIBRATED = "calibrated"


class Device(StrEnum):
    """Where a job runs (a config's ``device:``): the GPU if there is one, or the named one."""
    AUTO = "auto"
    CPU = "cpu"
    CUDA = "cuda"


class RopeKind(StrEnum):
    """A stage's ``rope_scaling.kind`` (stem.models.rope)."""
    NONE = "none"
    THETA = "theta"
    LINEAR = "linear"
    YARN = "yarn"
    LLAMA3 = "llama3"


class RopeRamp(StrEnum):
    """What YaRN's ramp is measured in (``rope_scaling.ramp``)."""
    ROTATIONS = "rotations"
    DIMS = "dims"


class DocKeys(StrEnum):
    """What a source's validation split and sampling hash (``sources.<name>.doc_keys``): a document's position
    or its content."""
    INDEX = "index"
    CONTENT = "content"


class SourceKind(StrEnum):
    SYNTH = "synth"
    FILES = "files"
    HF = "hf"
    MDS = "mds"


class TokenizerKind(StrEnum):
    TRAIN_BPE = "train_bpe"
    PRETRAINED = "pretrained"


class DSEMode(StrEnum):
    """The DSE-disabled analysis's modes (``analysis.dse_disabled.modes``): the memory switched off or forced."""
    DISABLED = "disabled"
    FORCED = "forced"


class CKATokens(StrEnum):
    """Which tokens the CKA analysis compares (``analysis.cka.tokens``)."""
    ENTITIES = "entities"
    ALL = "all"


def values(option: type[StrEnum]) -> tuple[str, ...]:
    return tuple(m.value for m in option)


class NameKind(StrEnum):
    """The knowledge experiment's names (stem.data.bios): one token each, first + last name (BPE tokens), or first +
    last name of two whole-word tokens (pools the tokenizer adds)."""
    ONE = "one"
    MULTI = "multi"
    PAIR = "pair"
