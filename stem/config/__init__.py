"""Experiment configs: load, validate (the typed tree of stem.config.experiment), and resolve into job specs.

A *job spec* is everything one workflow job needs, fully resolved (model config, optimisation,
data paths), so that entry points never read config files themselves and Snakemake can rerun exactly
the jobs whose spec changed (it is passed as a rule parameter).
"""
from __future__ import annotations

import copy
import dataclasses
import os
from functools import lru_cache

from stem import knowledge, plugins, seeds, specs, sweeps
from stem.config import experiment
from stem.config.experiment import Experiment, HFInit, Source
from stem.config.experiment import dataclass_mapping as mapping
from stem.io import ConfigError, deep_merge, read_yaml  # noqa: F401 (re-exported: C.ConfigError, C.deep_merge, C.read_yaml)
from stem.layout import REPO, VARIANTS  # noqa: F401 (re-exported: C.REPO)
from stem.layout import (GGUF_SEP, KNOWLEDGE, analysis_json, checkpoint, corpus_path, entity_text, stage_dir,
                         tokenizer_path, tokens_manifest)
from stem.models.spec import model_config
from stem.options import DocKeys, InsertInit, NameKind, Scale, SourceKind, Stage, TokenizerKind, values
from stem.seeds import JobId
from stem.specs import DataSource, Insert, Layout, StageOptions, StageSchedule, TrainSettings, TrainSpec, Variant

HF_PREFIX = "hf:"   # a job spec's init_from "hf:<hub id or folder>": a transformers checkpoint (stem.hf.importer)
SCALES = values(Scale)
STAGES = values(Stage)


# The resolvers below take the typed tree (stem.config.experiment.Experiment).


# ---- variants and models -------------------------------------------------------------------------
def variant_spec(exp: Experiment, variant: str) -> Variant:
    """A variant's node (stem.specs.Variant): one of config/variants.yaml (with variant_overrides), or a point of
    the config's ``sweeps:`` section (stem.sweeps: ``rho_0p75``, ``slots_4096``; its ``stage`` holds the stage
    settings it overrides) or of its knowledge sweep (stem.knowledge)."""
    all_variants = exp.variants()
    job = JobId.parse("", variant, "")   # a seed of a matrix cell (stem.seeds): the variant's own spec
    if job.seed and job.variant in all_variants:
        return all_variants[job.variant]
    if variant in all_variants:
        return all_variants[variant]
    if exp.knowledge and knowledge.is_point(variant):   # a point of the knowledge sweep (stem.knowledge)
        try:
            return knowledge.variant_spec(exp, variant)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if exp.sweeps and job.sweep:
        points = sweeps.variant_specs(sweeps.spec(exp))
        if variant in points:
            return points[variant]
        raise ConfigError(f"variant {variant!r}: not a point of the config's sweeps: section (expected one of "
                          f"{', '.join(points)})")
    raise ConfigError(f"variant {variant!r}: expected one of {sorted(all_variants)}")


def _overrides(exp: Experiment | None) -> dict:
    """The config's variant_overrides (none without a config)."""
    return exp.variant_overrides if exp is not None else {}


def _presentation(exp: Experiment | None, key: str) -> dict:
    """{variant: its ``key`` (label, figure_label, color, figures)}, the nodes of config/variants.yaml with the
    config's variant_overrides (stem.specs.variants), in that file's order."""
    return {name: getattr(v, key) for name, v in specs.variants(_overrides(exp)).items()}


def variant_labels(exp: Experiment | None = None) -> dict[str, str]:
    """{variant: its row label} in config/variants.yaml's order (each variant's ``label:``, the one source;
    with ``exp``'s variant_overrides): the tables' rows and their order, the figures' legends."""
    return {name: label or name for name, label in _presentation(exp, "label").items()}


def variant_figure_labels(exp: Experiment | None = None) -> dict[str, str]:
    """{variant: its figures' legend label}: ``figure_label:`` where a variant sets one, else its ``label:``."""
    return {name: fig or label for (name, fig), label in
            zip(_presentation(exp, "figure_label").items(), variant_labels(exp).values())}


def variant_colors(exp: Experiment | None = None) -> dict[str, str]:
    """{variant: its figures' colour} for the variants whose config/variants.yaml entry sets ``color:`` (the
    others are drawn in matplotlib's colour cycle)."""
    return {name: color for name, color in _presentation(exp, "color").items() if color}


def baseline_variant(exp: Experiment | None = None) -> str:
    """The variant every other is compared with (the diff's and the verdicts' directions, ROI, the analyses'
    deltas): the one config/variants.yaml marks ``baseline: true`` (with ``exp``'s variant_overrides)."""
    return experiment.baseline_variant(_overrides(exp))


def figure_variants(exp: Experiment | None, figure: str) -> tuple[str, ...]:
    """The variants report figure ``figure`` draws: those whose ``figures:`` name it (config/variants.yaml with
    ``exp``'s variant_overrides), in that file's order."""
    return tuple(name for name, figures in _presentation(exp, "figures").items() if figure in (figures or ()))


def model_config_for(exp: Experiment, scale: str, variant: str, stage: str | None = None):
    """The ModelConfig of a variant at a scale (and a stage's context); a knowledge point's with the points'
    vocabulary (stem.knowledge.vocab_size: their own tokenizer's)."""
    arch = mapping(exp.archs[scale])
    if exp.knowledge and knowledge.is_point(variant):
        arch["vocab_size"] = knowledge.vocab_size(exp)
    if stage is not None:
        spec = mapping(exp.stages[stage][scale])   # a key written null is kept, as the config writes it
        arch.update({key: spec[key] for key in ("max_seq_len", "rope_scaling") if key in spec})
    try:
        return model_config(arch, variant_spec(exp, variant).model_spec())
    except ConfigError:
        raise
    except ValueError as e:   # e.g. a placement outside the model's layers
        raise ConfigError(f"variant {variant!r} at {scale} (config/variants.yaml + variant_overrides): {e}") from None


def config_part(exp: Experiment, keys) -> dict:
    """The top-level sections ``keys`` of the experiment's config as it writes them (only those it writes; a node
    as its mapping, ``dataclass_mapping``): the ``params`` and sweep jobs' specs (rules/report.smk, rules/sweep.smk),
    read from the typed tree like every other rule's."""
    written = getattr(exp, "_written", frozenset(keys))   # the keys the config writes (stem.fields.node)
    return {k: mapping(getattr(exp, k)) for k in keys if k in written}


# ---- paths: stem.layout ------------------------------------------------------------------------
# Keys of a source that steer its tokenize jobs rather than describe its documents.
TOKENIZE_KEYS = ("max_tokens", "parts", "doc_keys", "sample", "val_fraction")


def source_of(exp: Experiment, source: str) -> Source:
    """The config's ``sources.<source>``; a source it does not define (e.g. a target path naming one) is one line
    naming it and the defined ones."""
    if source not in exp.sources:
        raise ConfigError(f"source {source!r}: not defined in the {exp.experiment} config's sources; expected one "
                          f"of {sorted(exp.sources)}")
    return exp.sources[source]


def source_mapping(src: Source) -> dict:
    """A source as the config writes it (its reader's keys beside the typed ones): a fresh copy of a mapping made
    once per source node (the paper DAG asks for it once per tokenize job: 832 times)."""
    return copy.deepcopy(_source_mapping(src))


def _source_mapping(src: Source) -> dict:
    hit = _SOURCE_MAPPINGS.get(id(src))
    if hit is None or hit[0] is not src:   # the node is kept in the entry, so its id is not reused
        hit = _SOURCE_MAPPINGS[id(src)] = (src, {k: v for k, v in {**mapping(src), **src.reader}.items()
                                                 if k != "reader"})
    return hit[1]


_SOURCE_MAPPINGS: dict[int, tuple[Source, dict]] = {}


def source_parts(exp: Experiment, source: str) -> int:
    """How many scattered tokenize jobs a source is split into (`parts`, default 1)."""
    return int(source_of(exp, source).parts or 1)


def part_names(exp: Experiment, source: str) -> list[str]:
    return list(_part_names(source_parts(exp, source)))


@lru_cache(maxsize=None)
def _part_names(n: int) -> tuple[str, ...]:
    return tuple(f"part{k:05d}-of-{n:05d}" for k in range(n))


def part_index(exp: Experiment, source: str, part: str) -> tuple[int, int]:
    """(k, n) of a part name of a source; a one-line error for a name that is not one of its parts."""
    n = source_parts(exp, source)
    k = int(part[4:9]) if len(part) == 18 and part.startswith("part") else -1
    if not (0 <= k < n and part == _part_names(n)[k]):
        raise ConfigError(f"source {source!r}: part {part!r} is not one of its {n} parts")
    return k, n


# ---- job specs -----------------------------------------------------------------------------------
def variant_stages(exp: Experiment, name: str, stages) -> list[str]:
    """The stages a variant trains: all, except for a mid-training insertion (``insert:``), which starts at
    ``insert.stage`` (from another variant's checkpoint of the stage before)."""
    v = exp.variant(name)
    ins = v.insert if v is not None else None
    return list(stages[stages.index(ins.stage):]) if ins and ins.stage in stages else list(stages)


def train_targets(exp: Experiment) -> list[tuple[str, str, str]]:
    return [(scale, v, stage) for scale, m in exp.matrix.items() for v in m.variants
            for stage in variant_stages(exp, v, m.stages)]


def seed_targets(exp: Experiment) -> list[tuple[str, str, str]]:
    """The training jobs of seeds beyond the matrix's own (stem.seeds): (scale, '{variant}_seed{k}', stage)."""
    return [(scale, JobId(scale, v, stage, k).slot, stage) for scale, m in exp.matrix.items() for v in m.variants
            for k in seeds.seeds_of(exp, scale, v) if k for stage in variant_stages(exp, v, m.stages)]


def _seed_job(exp: Experiment, job: JobId) -> TrainSpec:
    """Seed k of a matrix cell (stem.seeds): the cell's spec, its own seed and folder."""
    scale, variant, stage, base, k = job.scale, job.slot, job.stage, job.variant, job.seed
    if k not in seeds.seeds_of(exp, scale, base):
        raise ConfigError(f"variant {variant!r}: seed {k} of {base!r} at {scale} is not asked for by the "
                          f"{exp.experiment} config (seeds: {seeds.seeds_of(exp, scale, base)})")
    spec = train_job(exp, scale, base, stage)
    init = spec.init_stage
    return dataclasses.replace(spec, variant=variant, seed=exp.seed + k,
                               out_dir=stage_dir(exp.experiment, scale, variant, stage),
                               init_from=checkpoint(exp.experiment, scale, variant, init) if init else None)


def _check_job(exp: Experiment, job: JobId):
    """The job is one of the matrix (a variant's own stages) or a point of the sweeps (at its scale and stage)."""
    scale, variant, stage = job.scale, job.variant, job.stage
    m, sw, kn = exp.matrix.get(scale), exp.sweeps, exp.knowledge
    if kn and knowledge.is_point(variant):
        if (scale, stage) != (kn.scale, kn.stage):
            raise ConfigError(f"variant {variant!r}: a knowledge point, trained at knowledge.scale / knowledge.stage "
                              f"({kn.scale} / {kn.stage}), not at {scale} / {stage}")
    elif job.sweep:
        if (scale, stage) != (sw and sw.scale, sw and sw.stage):
            raise ConfigError(f"variant {variant!r}: a sweep point, trained at sweeps.scale / sweeps.stage "
                              f"({sw and sw.scale} / {sw and sw.stage}), not at {scale} / {stage}")
    elif m is None or stage not in m.stages:
        raise ConfigError(f"stage {stage!r} at scale {scale!r} is not in the {exp.experiment} experiment's matrix")
    elif stage not in variant_stages(exp, variant, m.stages):
        raise ConfigError(f"variant {variant!r}: inserted at stage {variant_spec(exp, variant).insert.stage!r}; "
                          f"it has no {stage!r} stage of its own")


def _init_from(exp: Experiment, scale: str, variant: str, init, ins) -> str | None:
    """The job spec's init_from: a transformers checkpoint (stem.hf; a GGUF file in it), the checkpoint of an
    earlier stage (of the dense variant an insertion starts from), or None."""
    if isinstance(init, HFInit):
        return HF_PREFIX + init.hf + (GGUF_SEP + init.gguf_file if init.gguf_file else "")
    return checkpoint(exp.experiment, scale, ins.from_ if ins else variant, init) if init else None


def train_job(exp: Experiment, scale: str, variant: str, stage: str) -> TrainSpec:
    """The fully resolved, checked spec of one training job (a stem.specs.TrainSpec), built from the tree's own
    nodes: the stage's ``StageSettings`` with the variant's (or sweep or knowledge point's) ``stage:`` keys set over
    it, ``Train`` with a sweep's ``sweeps.train`` intervals, the config's ``optim`` (an ``OptimSpec``) with the
    variant's ``optim:`` and the stage's ``table_group`` (``experiment.override``: ``dataclasses.replace``)."""
    job = JobId.parse(scale, variant, stage)   # the wildcards' one parser (stem.seeds)
    if job.seed:
        return _seed_job(exp, job)
    _check_job(exp, job)
    kpoint = bool(exp.knowledge and knowledge.is_point(variant))
    point = job.sweep is not None or kpoint
    tok = KNOWLEDGE if kpoint else scale   # a knowledge point reads its own tokenizer and shards
    vspec = variant_spec(exp, variant)
    over = dict(vspec.stage or {})
    intervals = {k: over.pop(k) for k in list(over) if k not in STAGE_KEYS}   # a sweep's eval_batches (Train)
    st = experiment.override(exp.stages[stage][scale], over, f"stages.{stage}.{scale}")
    ins = vspec.insert if not point and vspec.insert is not None and stage == vspec.insert.stage else None
    if ins is not None and (not st.init_from or st.reset_optimizer is False):
        raise ConfigError(f"variant {variant!r}: insert.stage {stage!r} needs stages.{stage}.{scale}.init_from (an "
                          "earlier stage of the dense variant, or {hf: ...}) and a fresh optimizer "
                          "(reset_optimizer: true)")
    optim = experiment.override(exp.optim, vspec.optim or {}, "optim")   # a variant may set e.g. table_update
    if st.table_group:   # this stage's table-group LR multiplier / weight decay
        group = {k: getattr(st.table_group, k) for k in ("lr_mult", "weight_decay")
                 if getattr(st.table_group, k) is not None}
        optim = experiment.override(optim, {"groups": {"table": group}}, "optim")
    init = st.init_from
    return TrainSpec(
        experiment=exp.experiment, scale=scale, variant=variant, stage=stage,
        seed=exp.seed + vspec.seed_index, device=exp.device,
        model=model_config_for(exp, scale, variant, stage), optim=optim,
        train=_train_settings(exp, scale, stage, st, experiment.override(exp.train, intervals, "train"), point),
        data={src: DataSource(w, tokens_manifest(exp.experiment, tok, src)) for src, w in st.data.items()},
        tokenizer=tokenizer_path(exp.experiment, tok), init_from=_init_from(exp, scale, variant, init, ins),
        init_stage=None if isinstance(init, HFInit) else init,
        out_dir=stage_dir(exp.experiment, scale, variant, stage),
        insert=None if ins is None else _insert_spec(exp, scale, variant, ins, st.data, init),
        plugins=tuple(plugins.spec_key(exp).get("plugins", ())))


STAGE_KEYS = tuple(f.name for f in dataclasses.fields(experiment.StageSettings))
# the job's train section takes these of the stage node, the intervals and the cluster: the same fields
STAGE_FIELDS = tuple(f.name for f in (*dataclasses.fields(StageSchedule), *dataclasses.fields(StageOptions)))
LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(Layout))


def _train_settings(exp: Experiment, scale: str, stage: str, st, intervals, point: bool) -> TrainSettings:
    """The job's ``train`` section: the stage's schedule and options (``StageSchedule``, ``StageOptions``: the
    same fields), the config's intervals (``Train``), the cluster's layout (``Layout``: the same fields).
    reset_optimizer false carries the optimizer state of init_from's stage, which then saves it in its checkpoint
    (checkpoint/optimizer/)."""
    return TrainSettings(
        **{k: getattr(st, k) for k in STAGE_FIELDS}, **intervals.settings(),
        **{k: getattr(exp.cluster, k) for k in LAYOUT_FIELDS},
        save_optimizer=not point and any(exp.stages[s][scale].init_from == stage
                                         and exp.stages[s][scale].reset_optimizer is False
                                         for s in exp.matrix[scale].stages),
        # the plan picks a micro-batch / checkpointing / host tables that fit
        **({"fit_gib": exp.cluster.gpu_mem_gib} if exp.cluster.fit_memory else {}))


def _insert_spec(exp: Experiment, scale: str, variant: str, ins: Insert, data: dict, init) -> dict:
    """A train job's ``insert``: the dense variant and the init; init ``calibrated`` also its calibration source's
    manifest (``insert.calibration.source``, default the stage's first data source) and settings (every key of
    ``TrainCalibration`` but ``from_step0``; an OPTIONAL one where it is not at its default); with ``from_step0``,
    the step-0 analysis of the dense checkpoint it starts from (its best choice is taken)."""
    out = {"from": ins.from_, "init": ins.init}
    if ins.init != InsertInit.CALIBRATED:
        return out
    c = ins.settings
    cal = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name != "from_step0"
           and not (f.metadata.get("omit_default") and getattr(c, f.name) == f.default)}
    cal["source"] = c.source or next(iter(data))
    if c.from_step0:
        stages = (exp.analysis.stages or {}).get(scale) or []
        if exp.analysis.insertion_step0 is None or isinstance(init, HFInit) or init not in stages:
            raise ConfigError(f"variant {variant!r}: key 'insert.calibration.from_step0': true, but no step-0 "
                              f"analysis of {ins.from_!r} at {scale} / {init!r}; expected analysis.insertion_step0 "
                              f"and {init!r} in analysis.stages.{scale}")
        cal["step0"] = analysis_json(exp.experiment, scale, ins.from_, init, "insertion_step0")
    if c.entities is not None:   # texts the dense checkpoint writes about the facts' entities (rule entity_text)
        cal["entities"] = _entity_spec(variant, dataclasses.asdict(c.entities),
                                       entity_text(exp.experiment, scale, ins.from_, init)
                                       if not isinstance(init, HFInit) else None)
    return {**out, "calibration": {**cal, "manifest": tokens_manifest(exp.experiment, scale, cal["source"])}}


def _entity_spec(variant: str, ent: dict, out: str | None) -> dict:
    """``insert.calibration.entities`` as the jobs read it: the facts file's path in the repository, and ``out``, the
    entity_text job's JSON (stem.layout.entity_text) of the dense checkpoint the insertion starts from."""
    facts = ent["facts"] if os.path.isabs(ent["facts"]) else str(REPO / ent["facts"])
    if not os.path.isfile(facts):
        raise ConfigError(f"variant {variant!r}: key 'insert.calibration.entities.facts': {ent['facts']!r}: no such "
                          f"file (expected a facts file such as reference/real/facts.yaml)")
    if out is None:
        raise ConfigError(f"variant {variant!r}: key 'insert.calibration.entities': the insertion starts from a "
                          f"transformers checkpoint; expected a dense stage of this experiment to write the texts")
    return {**ent, "prompts": list(ent["prompts"]), "facts": facts, "out": out}


def entity_text_spec(exp: Experiment, scale: str, variant: str, stage: str) -> dict:
    """The entity_text job of the dense checkpoint ``variant``/``stage``: the ``entities`` settings of the first
    insertion that reads it (ConfigError if two read it with different settings)."""
    out, found = entity_text(exp.experiment, scale, variant, stage), []
    for v, st in ((v, st) for sc, v, st in train_targets(exp) if sc == scale):
        ins = train_spec(exp, scale, v, st).get("insert") or {}
        ent = (ins.get("calibration") or {}).get("entities")
        if ent and ent["out"] == out and ent not in found:
            found.append(ent)
    if len(found) != 1:
        why = "no insertion reads it" if not found else "two insertions read it with different settings"
        raise ConfigError(f"{out}: {why}; expected one insert.calibration.entities")
    return {k: v for k, v in found[0].items() if k != "out"}


def train_spec(exp: Experiment, scale: str, variant: str, stage: str) -> dict:
    """The JSON form of ``train_job``: what the train rule passes to its job (``--spec``)."""
    return train_job(exp, scale, variant, stage).to_dict()


def corpus_spec(exp: Experiment, source: str) -> dict:
    src = source_of(exp, source)
    if src.kind != SourceKind.SYNTH:
        raise ConfigError(f"source {source!r}: no corpus to generate (only kind 'synth' sources have one)")
    bios = src.generator == "bios"   # only a bios corpus carries the knowledge world (tiny's others unchanged)
    return {"source": source, "world": mapping(exp.world) if exp.world else {}, "seed": exp.seed,
            **source_mapping(src), **plugins.spec_key(exp), **(_knowledge_key(exp) if bios else {})}


def _knowledge_key(exp: Experiment) -> dict:
    """The knowledge section's world (stem.data.bios: seed, names, name_kind, attributes, templates) for a job
    that builds it; nothing without one (the other experiments' specs are unchanged)."""
    if exp.knowledge is None:
        return {}
    kn = mapping(exp.knowledge)
    keys = ("seed", "names", "name_kind", "attributes", "templates") + (("pair_pool",) if kn.get("pair_pool") else ())
    return {"knowledge": {k: kn[k] for k in keys}}


def documents_spec(exp: Experiment, source: str) -> dict:
    """The reader spec of a source's documents (a synth source is read back from its corpus file)."""
    src = source_of(exp, source)
    if src.kind == SourceKind.SYNTH:
        return {"kind": "files", "paths": [corpus_path(exp.experiment, source)], "format": "jsonl"}
    return {k: v for k, v in source_mapping(src).items() if k not in TOKENIZE_KEYS}


def source_inputs(exp: Experiment, source: str) -> list[str]:
    synth = source_of(exp, source).kind == SourceKind.SYNTH
    return [corpus_path(exp.experiment, source)] if synth else []


def tokenizer_node(exp: Experiment, key: str):
    """The tokenizer of a data key (stem.layout): ``tokenizer.<scale>``, or ``knowledge.tokenizer`` for KNOWLEDGE."""
    if key == KNOWLEDGE:
        if exp.knowledge is None:
            raise ConfigError(f"tokenizer {KNOWLEDGE!r}: the {exp.experiment} config has no knowledge: section")
        return exp.knowledge.tokenizer
    return exp.tokenizer[key]


def tokenizer_spec(exp: Experiment, scale: str) -> dict:
    """The tokenizer job's spec; ``scale``: a data key (a scale, or KNOWLEDGE)."""
    tok = mapping(tokenizer_node(exp, scale))
    if tok["kind"] == TokenizerKind.TRAIN_BPE:
        tok["documents"] = [documents_spec(exp, s) for s in tok["sources"]]
    if tok.get("add_names"):   # the knowledge experiment's one-token names (stem.data.bios)
        tok.update(_knowledge_key(exp))
        if exp.knowledge.name_tokens:   # only the pool's first one-token names are tokens (only then: specs unchanged)
            tok["knowledge"]["name_tokens"] = exp.knowledge.name_tokens
        if any(knowledge.name_kind(exp, s) == NameKind.PAIR for s in exp.knowledge.sources):
            tok["add_pair_names"] = True   # and the pools of the pair names (only then: other specs unchanged)
    return tok


def tokenize_spec(exp: Experiment, scale: str, source: str, part: str | None = None) -> dict:
    """Spec of one tokenize job: part k of n of a source (``part`` as named by ``part_names``).
    ``max_tokens`` is split evenly over the parts; ``sample`` is a [lo, hi) range of the per-document
    uniform (or a mapping scale -> range), see stem.data.shards.tokenize_to_shards. ``scale``: a data key (a scale,
    or KNOWLEDGE: the shards of the knowledge section's tokenizer, at its points' vocabulary)."""
    src = source_of(exp, source)
    k, n = part_index(exp, source, part or _part_names(source_parts(exp, source))[0])
    sample = src.sample
    if isinstance(sample, dict):
        if scale not in sample:
            raise ConfigError(f"key 'sources.{source}.sample': no range for scale {scale!r} (have {sorted(map(str, sample))})")
        sample = sample[scale]
    if sample is not None and src.doc_keys != DocKeys.CONTENT:
        raise ConfigError(f"key 'sources.{source}.sample' needs doc_keys: content (a document's position "
                          "depends on how the source is split into parts)")
    return {"documents": documents_spec(exp, source), "seed": exp.seed,
            "max_tokens": None if src.max_tokens is None else -(-int(src.max_tokens) // n),
            "vocab_size": knowledge.vocab_size(exp) if scale == KNOWLEDGE else exp.archs[scale].vocab_size,
            "part": [k, n],
            "doc_keys": src.doc_keys or DocKeys.INDEX, "sample": None if sample is None else list(sample),
            # the held-out share of documents (stem.data.shards.val_mask; only where the source sets it, so the
            # other experiments' job specs stay as they were)
            **({"val_fraction": src.val_fraction} if src.val_fraction is not None else {})}
