"""Where every file of the workflow lives: the one place for the paths the rules (rules/*.smk) declare and
the code reads and writes.

    data/{experiment}/corpus/{source}.jsonl                     synthetic corpora
    data/{experiment}/{scale}/tokenizer/tokenizer.json
    data/{experiment}/{scale}/tokens/{source}/[{part}/]manifest.json
    data/{experiment}/fixtures/                                 offline eval fixtures (tiny)
    results/{experiment}/{scale}/{variant}/{stage}/             one training job ("stage folder"):
        summary.json, metrics.jsonl, checkpoint/, _state/ (resumable, undeclared), tensorboard/,
        eval/{suite}.json, eval/raw/{suite}.json, analysis/{name}.json
    logs/{experiment}/{scale}/{variant}/{stage}/train.log, .../eval/{suite}.log, .../analysis/{name}.log
    reports/{experiment}/sweeps/{kind}.{json,md,png,pdf}          the DSE paper's Sec. 3 sweeps (stem.sweeps)
    logs/{experiment}/sweeps/{kind}.log

Every function takes the path's parts; called with wildcard names (``"{experiment}"``, ...; ``STAGE``) it
gives the rule's pattern, so a rule and the code cannot disagree. Torch-free (the Snakefile imports it).
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]      # the repository (the workflow's working directory)
VARIANTS = REPO / "config" / "variants.yaml"     # the named variants (stem.io.variants reads it)
IDENTITY = ("experiment", "scale", "variant", "stage")
STAGE = tuple("{" + k + "}" for k in IDENTITY)   # wildcards: stage_dir(*STAGE) is the rules' pattern
# what a training job writes in its stage folder (a train spec's ``out_dir``)
SUMMARY, METRICS, CHECKPOINT, STATE, TENSORBOARD = "summary.json", "metrics.jsonl", "checkpoint", "_state", "tensorboard"


# ---- data ------------------------------------------------------------------------------------------
def corpus_path(exp: str, source: str) -> str:
    return f"data/{exp}/corpus/{source}.jsonl"


def tokenizer_path(exp: str, scale: str) -> str:
    return f"data/{exp}/{scale}/tokenizer/tokenizer.json"


def tokens_dir(exp: str, scale: str, source: str) -> str:
    return f"data/{exp}/{scale}/tokens/{source}"


def tokens_manifest(exp: str, scale: str, source: str) -> str:
    return f"{tokens_dir(exp, scale, source)}/manifest.json"


def tokens_part_dir(exp: str, scale: str, source: str, part: str) -> str:
    return f"{tokens_dir(exp, scale, source)}/{part}"


def fixtures_dir(exp: str) -> str:
    return f"data/{exp}/fixtures"


# ---- one training job's folder ------------------------------------------------------------------------
def stage_dir(exp: str, scale: str, variant: str, stage: str) -> str:
    return f"results/{exp}/{scale}/{variant}/{stage}"


def summary(exp: str, scale: str, variant: str, stage: str) -> str:
    return f"{stage_dir(exp, scale, variant, stage)}/{SUMMARY}"


def metrics(exp: str, scale: str, variant: str, stage: str) -> str:
    return f"{stage_dir(exp, scale, variant, stage)}/{METRICS}"


def checkpoint(exp: str, scale: str, variant: str, stage: str) -> str:
    return f"{stage_dir(exp, scale, variant, stage)}/{CHECKPOINT}"


def hf_export(exp: str, scale: str, variant: str, stage: str) -> str:
    """The checkpoint as a transformers folder (python -m stem export-hf; rules/hf.smk, not in rule all)."""
    return f"{stage_dir(exp, scale, variant, stage)}/hf"


def eval_json(exp: str, scale: str, variant: str, stage: str, suite: str) -> str:
    return f"{stage_dir(exp, scale, variant, stage)}/eval/{suite}.json"


def eval_raw(exp: str, scale: str, variant: str, stage: str, suite: str) -> str:
    return f"{stage_dir(exp, scale, variant, stage)}/eval/raw/{suite}.json"


def analysis_json(exp: str, scale: str, variant: str, stage: str, name: str) -> str:
    return f"{stage_dir(exp, scale, variant, stage)}/analysis/{name}.json"


def analysis_log(exp: str, scale: str, variant: str, stage: str, name: str) -> str:
    return f"logs/{exp}/{scale}/{variant}/{stage}/analysis/{name}.log"


def train_log(exp: str, scale: str, variant: str, stage: str) -> str:
    return f"logs/{exp}/{scale}/{variant}/{stage}/train.log"


def eval_log(exp: str, scale: str, variant: str, stage: str, suite: str) -> str:
    return f"logs/{exp}/{scale}/{variant}/{stage}/eval/{suite}.log"


# ---- sweeps (stem.sweeps, rules/sweep.smk) ---------------------------------------------------------------
SWEEP_FILES = ("json", "md", "png", "pdf")


def sweep_dir(exp: str) -> str:
    return f"reports/{exp}/sweeps"


def sweep_file(exp: str, kind: str, ext: str) -> str:
    """A sweep's result (json), its table (md) or its figure (png, pdf)."""
    return f"{sweep_dir(exp)}/{kind}.{ext}"


def sweep_files(exp: str, kind: str) -> list[str]:
    return [sweep_file(exp, kind, ext) for ext in SWEEP_FILES]


def sweep_log(exp: str, kind: str) -> str:
    return f"logs/{exp}/sweeps/{kind}.log"


def state_dir(out_dir) -> Path:
    """A stage folder's resumable training state (undeclared to Snakemake, so a failed job keeps it)."""
    return Path(out_dir) / STATE


def eval_identity(path) -> dict | None:
    """The experiment/scale/variant/stage an eval JSON's path names (``eval_json``'s inverse), else None."""
    parts = Path(path).resolve().parts
    if len(parts) >= 7 and parts[-7] == "results" and parts[-2] == "eval":
        return dict(zip(IDENTITY, parts[-6:-2]))
    return None


def checkpoint_identity(path) -> dict | None:
    """The experiment/scale/variant/stage a checkpoint folder's path names (``checkpoint``'s inverse:
    ``.../results/{experiment}/{scale}/{variant}/{stage}/checkpoint``), else None."""
    parts = Path(path).resolve().parts
    if len(parts) >= 6 and parts[-6] == "results" and parts[-1] == CHECKPOINT:
        return dict(zip(IDENTITY, parts[-5:-1]))
    return None
