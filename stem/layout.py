"""Where every file of the workflow lives: the one place for the paths the rules (rules/*.smk) declare and
the code reads and writes.

    data/{experiment}/corpus/{source}.jsonl                     synthetic corpora
    data/{experiment}/{scale}/tokenizer/tokenizer.json
    data/{experiment}/{scale}/tokens/{source}/[{part}/]manifest.json
    data/{experiment}/knowledge/tokenizer/tokenizer.json, .../knowledge/tokens/{source}/   the knowledge section's
                                                                own (``KNOWLEDGE`` in the scale's place: its points)
    data/{experiment}/fixtures/                                 offline eval fixtures (tiny)
    results/{experiment}/{scale}/{variant}/{stage}/             one training job ("stage folder"):
        summary.json, metrics.jsonl, checkpoint/, _state/ (resumable, undeclared), tensorboard/,
        eval/{suite}.json, eval/raw/{suite}.json, analysis/{name}.json
    logs/{experiment}/{scale}/{variant}/{stage}/train.log, .../eval/{suite}.log, .../analysis/{name}.log,
        .../export_hf.log
    logs/{experiment}/corpus/{source}.log, {scale}/tokenizer.log, {scale}/tokenize/{source}/{part}.log and
        gather.log, eval/fixtures.log                            the data and fixture jobs
    reports/{experiment}/                                        the report (rules/report.smk, stem.report):
        params.{csv,md}, tables/{table}.{csv,md,tex}, tables/reproduced.csv, diff/{diff.md, cells.csv,
        directions.csv, paper_consistency.csv, summary.json}, figures/{figure}.{png,pdf}, README.md, report.html
    reports/{experiment}/offload/[{variant}/]offload.{json,md}    the offload benchmark (rules/bench.smk)
    reports/{experiment}/sweeps/{kind}.{json,md,png,pdf}          the DSE paper's Sec. 3 sweeps (stem.sweeps)
    logs/{experiment}/sweeps/{kind}.log
    logs/{experiment}/{job}.log                                   the experiment's other jobs (report, bench)
    results/memory_traces/, reports/gpucheck/                     caches and checks outside the workflow's jobs
    data/rehearsal/hub/                                           the one-node rehearsal's offline inputs

Every function takes the path's parts; called with wildcard names (``"{experiment}"``, ...; ``STAGE``) it
gives the rule's pattern, so a rule and the code cannot disagree. Torch-free (the Snakefile imports it).
"""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]      # the repository (the workflow's working directory)
VARIANTS = REPO / "config" / "variants.yaml"     # the named variants (stem.specs.variants parses it)
IDENTITY = ("experiment", "scale", "variant", "stage")
STAGE = tuple("{" + k + "}" for k in IDENTITY)   # wildcards: stage_dir(*STAGE) is the rules' pattern
# what a training job writes in its stage folder (a train spec's ``out_dir``)
SUMMARY, METRICS, CHECKPOINT, STATE, TENSORBOARD = "summary.json", "metrics.jsonl", "checkpoint", "_state", "tensorboard"
GGUF_SEP = "#gguf="   # a job spec's init_from "hf:<folder>#gguf=<file name>": a GGUF file in that folder (stem.hf.importer)


# ---- data ------------------------------------------------------------------------------------------
# The key of a tokenizer and its token shards: a scale, or KNOWLEDGE, the knowledge section's own tokenizer
# (``knowledge.tokenizer``: the one-token names added), which its points read (stem.knowledge) whatever the
# experiment; not a scale: no architecture, no matrix cell, no report row is keyed by it.
KNOWLEDGE = "knowledge"


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


def entity_text(exp: str, scale: str, variant: str, stage: str) -> str:
    """The texts a dense checkpoint writes about the facts' entities (insert.calibration.entities)."""
    return f"{stage_dir(exp, scale, variant, stage)}/entity_text.json"


def entity_text_log(exp: str, scale: str, variant: str, stage: str) -> str:
    return f"logs/{exp}/{scale}/{variant}/{stage}/entity_text.log"


def analysis_log(exp: str, scale: str, variant: str, stage: str, name: str) -> str:
    return f"logs/{exp}/{scale}/{variant}/{stage}/analysis/{name}.log"


def train_log(exp: str, scale: str, variant: str, stage: str) -> str:
    return f"logs/{exp}/{scale}/{variant}/{stage}/train.log"


def eval_log(exp: str, scale: str, variant: str, stage: str, suite: str) -> str:
    return f"logs/{exp}/{scale}/{variant}/{stage}/eval/{suite}.log"


def export_hf_log(exp: str, scale: str, variant: str, stage: str) -> str:
    return f"logs/{exp}/{scale}/{variant}/{stage}/export_hf.log"


# ---- logs of the data and fixture jobs (rules/data.smk, rules/eval.smk) -----------------------------------
def corpus_log(exp: str, source: str) -> str:
    return f"logs/{exp}/corpus/{source}.log"


def tokenizer_log(exp: str, scale: str) -> str:
    return f"logs/{exp}/{scale}/tokenizer.log"


def tokenize_log(exp: str, scale: str, source: str, part: str) -> str:
    return f"logs/{exp}/{scale}/tokenize/{source}/{part}.log"


def tokens_gather_log(exp: str, scale: str, source: str) -> str:
    return f"logs/{exp}/{scale}/tokenize/{source}/gather.log"


def fixtures_log(exp: str) -> str:
    return f"logs/{exp}/eval/fixtures.log"


def experiment_log(exp: str, job: str) -> str:
    """The log of one of the experiment's own jobs (params, report_tables, report_figure_{figure}, bench_offload,
    ...)."""
    return f"logs/{exp}/{job}.log"


# ---- the report (rules/report.smk, stem.report) -----------------------------------------------------------
PARAMS_FILES = ("csv", "md")
TABLE_FILES = ("csv", "md", "tex")
FIGURE_FILES = ("png", "pdf")
REPRODUCED = "reproduced"   # tables/reproduced.csv: every table, long format
DIFF_FILES = ["diff.md", "cells.csv", "directions.csv", "paper_consistency.csv", "summary.json"]


def report_dir(exp: str) -> str:
    return f"reports/{exp}"


def params_file(exp: str, ext: str) -> str:
    """The parameter accounting (csv, md)."""
    return f"{report_dir(exp)}/params.{ext}"


def tables_dir(exp: str) -> str:
    return f"{report_dir(exp)}/tables"


def table_file(exp: str, table: str, ext: str) -> str:
    return f"{tables_dir(exp)}/{table}.{ext}"


def reproduced(exp: str) -> str:
    return table_file(exp, REPRODUCED, "csv")


def diff_dir(exp: str) -> str:
    return f"{report_dir(exp)}/diff"


def diff_file(exp: str, name: str) -> str:
    """One of the paper diff's files (``DIFF_FILES``)."""
    return f"{diff_dir(exp)}/{name}"


def figures_dir(exp: str) -> str:
    return f"{report_dir(exp)}/figures"


def figure_file(exp: str, figure: str, ext: str) -> str:
    return f"{figures_dir(exp)}/{figure}.{ext}"


def report_readme(exp: str) -> str:
    return f"{report_dir(exp)}/README.md"


def report_html(exp: str) -> str:
    return f"{report_dir(exp)}/report.html"


# ---- the offload benchmark (rules/bench.smk) ---------------------------------------------------------------
def offload_file(exp: str, ext: str, variant: str | None = None) -> str:
    """The benchmark's result (json) or printed table (md): the experiment's 350m STEM checkpoint, or
    ``variant``'s."""
    return f"{report_dir(exp)}/offload/{variant + '/' if variant else ''}offload.{ext}"


# ---- outside the workflow's jobs ---------------------------------------------------------------------------
MEMORY_TRACES = "results/memory_traces"   # cached memory traces of the paper's training jobs (stem.train.memory)
GPUCHECK_DIR = "reports/gpucheck"         # python -m stem gpucheck
REHEARSAL_HUB = "data/rehearsal/hub"      # python -m stem rehearsal-data: config/rehearsal.yaml's offline inputs


# ---- sweeps (stem.sweeps, rules/sweep.smk) ---------------------------------------------------------------
SWEEP_FILES = ("json", "md", "png", "pdf")


def sweep_dir(exp: str) -> str:
    return f"{report_dir(exp)}/sweeps"


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
