"""Experiment configs: load, validate (schema + cross-references), and resolve into job specs.

A *job spec* is everything one workflow job needs, fully resolved (model config, optimisation,
data paths), so that entry points never read config files themselves and Snakemake can rerun exactly
the jobs whose spec changed (it is passed as a rule parameter).
"""
from __future__ import annotations

import math
from functools import lru_cache

from stem import plugins, seeds, sweeps
from stem.io import ConfigError, read_yaml, variant, variants, variants_file  # noqa: F401 (re-exported: C.ConfigError, C.read_yaml)
from stem.io import deep_merge as _deep_merge
from stem.layout import REPO, VARIANTS  # noqa: F401 (re-exported: C.REPO)
from stem.layout import GGUF_SEP, checkpoint, corpus_path, stage_dir, tokenizer_path, tokens_manifest
from stem.models.config import DSEConfig, model_config
from stem.options import InsertInit, Scale, Stage, Truncation, values
from stem.registry import ANALYSES, FFN_KINDS, GENERATORS, SUITE_KINDS  # names only: entries load on use
from stem.specs import TrainSpec
from stem.sweeps import is_sweep_id

SCHEMA = REPO / "config" / "schema.yaml"
HF_PREFIX = "hf:"   # a job spec's init_from "hf:<hub id or folder>": a transformers checkpoint (stem.hf.importer)
SCALES = values(Scale)
STAGES = values(Stage)
TRAIN_DEFAULTS = {"log_interval": 10, "eval_interval": 100, "eval_batches": 4, "checkpoint_interval": 100,
                  "tensorboard": False}


def load_experiment(path) -> dict:
    return validate_experiment(read_yaml(path), origin=str(path))


def validate_experiment(cfg: dict, origin: str = "config") -> dict:
    import jsonschema   # only when a config is checked (every job imports stem.config, none checks one)

    schema = read_yaml(SCHEMA)
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(cfg), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        key = ".".join(str(p) for p in e.path) or "<top level>"
        raise ConfigError(f"{origin}: key '{key}': {e.message}")
    try:   # a config's own plugin modules register their kinds, tables, analyses before anything is looked up
        plugins.load(cfg.get("plugins"), origin=f"{origin}: key 'plugins'")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _cross_check(cfg, origin)
    seeds.check(cfg, origin)
    return cfg


def _check_sources(cfg: dict, origin: str):
    """Every source name a mixture, a tokenizer or an eval suite the matrix runs uses is one of ``sources``."""
    known = sorted(cfg["sources"])
    uses = [(f"stages.{stage}.{scale}.data", list((spec or {}).get("data") or {}))
            for stage, by_scale in cfg["stages"].items() for scale, spec in (by_scale or {}).items()]
    uses += [(f"tokenizer.{scale}.sources", tok.get("sources") or []) for scale, tok in cfg["tokenizer"].items()]
    ev = cfg.get("eval") or {}
    run = {suite for m in cfg["matrix"].values() for stage in m["stages"]
           for suite in (ev.get("stages") or {}).get(stage) or []}
    for name, suite in (ev.get("suites") or {}).items():
        uses += [(f"eval.suites.{name}.{key}", [suite[key]]) for key in ("haystack", "source")
                 if name in run and isinstance(suite, dict) and key in suite]
        if name in run and isinstance(suite, dict) and isinstance(suite.get("categories"), dict):   # longppl
            uses.append((f"eval.suites.{name}.categories", list(suite["categories"].values())))
    uses += [(f"analysis.{name}.source", [a["source"]]) for name, a in (cfg.get("analysis") or {}).items()
             if isinstance(a, dict) and "source" in a]
    for key, names in uses:
        unknown = [s for s in names if s not in cfg["sources"]]
        if unknown:
            raise ConfigError(f"{origin}: key '{key}': unknown source {unknown[0]!r}; expected one of {known}")


def _check_suite_kinds(cfg: dict, origin: str):
    """Every eval suite's kind (default lm_eval) is a registered one (stem.registry.SUITE_KINDS); its
    ``truncation`` one of the policies (NIAH: error only, its prompts are never cut)."""
    for name, suite in ((cfg.get("eval") or {}).get("suites") or {}).items():
        kind = suite.get("kind", "lm_eval") if isinstance(suite, dict) else None
        if kind not in SUITE_KINDS:
            raise ConfigError(f"{origin}: key 'eval.suites.{name}.kind': unknown suite kind {kind!r}; "
                              f"expected one of {sorted(SUITE_KINDS)}")
        allowed = ("error",) if kind == "niah" else values(Truncation)
        if suite.get("truncation", allowed[0]) not in allowed:
            raise ConfigError(f"{origin}: key 'eval.suites.{name}.truncation': {suite['truncation']!r}; expected "
                              + ("error (NIAH prompts are built to fit their cells, never cut)" if kind == "niah"
                                 else f"one of {', '.join(allowed)}"))


def _check_long_context(cfg: dict, origin: str):
    """The long-context evaluation's keys (the DSE paper's Table 2): a suite's ``variants`` (only those variants'
    checkpoints get it), a ``longppl`` suite's categories, sizes, thresholds and evaluator, and the fixtures'
    RULER stand-in (``eval.fixtures.ruler``: the scale whose tokenizer sizes its items, lengths, generation room)."""
    ev = cfg.get("eval") or {}
    known = set(variants(cfg))
    whole = lambda v, lo: isinstance(v, int) and not isinstance(v, bool) and v >= lo   # noqa: E731
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)        # noqa: E731

    def bad(key, value, expected):
        raise ConfigError(f"{origin}: key '{key}': {value!r}; expected {expected}")
    for name, suite in (ev.get("suites") or {}).items():
        where = f"eval.suites.{name}"
        if "variants" in suite and not (isinstance(suite["variants"], list) and suite["variants"]
                                        and set(suite["variants"]) <= known):
            bad(f"{where}.variants", suite["variants"], "a non-empty list of variants of config/variants.yaml")
        if "metadata" in suite and not isinstance(suite["metadata"], dict):   # lm-eval's task metadata (RULER)
            bad(f"{where}.metadata", suite["metadata"], "a mapping (e.g. {max_seq_lengths: [32768]})")
        if suite.get("kind") != "longppl":
            continue
        if not isinstance(suite.get("categories"), dict) or not suite["categories"]:
            bad(f"{where}.categories", suite.get("categories"), "a mapping {column: source} (e.g. {book: long})")
        for key, lo in (("documents", 1), ("short", 1), ("window", 1), ("length", 2)):
            if key in suite and not whole(suite[key], lo):
                bad(f"{where}.{key}", suite[key], f"an integer >= {lo}")
        for key in ("alpha", "beta"):
            if key in suite and not number(suite[key]):
                bad(f"{where}.{key}", suite[key], "a number (nats)")
        if suite.get("evaluator", "dense") not in known | {"self"}:
            bad(f"{where}.evaluator", suite["evaluator"], "self or a variant of config/variants.yaml")
    ruler = (ev.get("fixtures") or {}).get("ruler")
    if ruler is not None:
        if not isinstance(ruler, dict) or ruler.get("scale") not in cfg["tokenizer"]:
            bad("eval.fixtures.ruler.scale", (ruler or {}).get("scale") if isinstance(ruler, dict) else ruler,
                f"a scale of the config's tokenizer section ({', '.join(cfg['tokenizer'])})")
        if not (isinstance(ruler.get("lengths"), list) and ruler["lengths"] and all(whole(n, 2) for n in ruler["lengths"])):
            bad("eval.fixtures.ruler.lengths", ruler.get("lengths"), "a non-empty list of token counts >= 2")
        if not whole(ruler.get("max_gen_toks"), 1):
            bad("eval.fixtures.ruler.max_gen_toks", ruler.get("max_gen_toks"), "an integer >= 1")


def _check_registered(cfg: dict, origin: str):
    """The analyses and synthetic generators the config names are registered ones (stem.registry)."""
    for name in cfg.get("analysis") or {}:
        if name != "stages" and name not in ANALYSES:
            raise ConfigError(f"{origin}: key 'analysis.{name}': unknown analysis; expected stages or one of "
                              f"{', '.join(ANALYSES)}")
    for name, src in cfg["sources"].items():
        if src.get("kind") == "synth" and "generator" in src and src["generator"] not in GENERATORS:
            raise ConfigError(f"{origin}: key 'sources.{name}.generator': unknown generator "
                              f"{src.get('generator')!r}; expected one of {', '.join(GENERATORS)}")


def _check_variant_optim(cfg: dict, name: str, optim, origin: str):
    import jsonschema   # likewise: only when a config is checked
    schema = read_yaml(SCHEMA)["properties"]["optim"]
    merged = _deep_merge(cfg["optim"], optim) if isinstance(optim, dict) else optim
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(merged), key=lambda e: list(e.path))
    if errors:
        key = ".".join(["optim", *map(str, errors[0].path)])
        raise ConfigError(f"{origin}: variant '{name}' (config/variants.yaml + variant_overrides): key '{key}': "
                          f"{errors[0].message}")


def _check_variant_dse(name: str, dse, origin: str):
    where = f"{origin}: variant '{name}' (config/variants.yaml + variant_overrides)"
    if not isinstance(dse, dict):
        raise ConfigError(f"{where}: key 'dse': {dse!r}; expected a mapping (placement, orders, heads, ...)")
    fields = {k: tuple(v) if k == "orders" and isinstance(v, list) else v for k, v in dse.items() if k != "placement"}
    unknown = sorted(set(fields) - set(DSEConfig.__dataclass_fields__) - {"layers"})
    if unknown:
        raise ConfigError(f"{where}: key 'dse.{unknown[0]}': unknown; expected placement or one of "
                          f"{', '.join(f for f in DSEConfig.__dataclass_fields__ if f != 'layers')}")
    try:
        DSEConfig(**fields)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: key {str(e).split('=')[0]!r}: {e}") from None


def _check_variant_insert(cfg: dict, name: str, spec: dict, origin: str):
    """A mid-training insertion (stem.models.insert) builds STEM tables from a dense model's up-projections: its
    ``insert.from`` is a dense variant (no other FFN kind, no DSE memory), its ``init`` a known one, its own FFN
    kind ``stem``; found here, not when the insertion job starts."""
    where = f"{origin}: variant '{name}' (config/variants.yaml + variant_overrides)"
    ins = spec["insert"]
    if not isinstance(ins, dict) or not {"from", "stage"} <= set(ins):
        raise ConfigError(f"{where}: key 'insert': {ins!r}; expected {{from: <dense variant>, stage: <stage>, "
                          f"init: {' | '.join(values(InsertInit))}}}")
    if ins.get("init", InsertInit.PROJECTED) not in values(InsertInit):
        raise ConfigError(f"{where}: key 'insert.init': {ins['init']!r}; expected one of "
                          f"{', '.join(values(InsertInit))}")
    if spec.get("ffn", "dense") != "stem":
        raise ConfigError(f"{where}: key 'ffn': {spec.get('ffn', 'dense')!r}; an insertion builds ffn kind 'stem'")
    src = variant(cfg, ins["from"])
    if src is None:
        raise ConfigError(f"{where}: key 'insert.from': {ins['from']!r} is not a variant of config/variants.yaml; "
                          f"expected a dense one")
    if src.get("ffn", "dense") != "dense" or src.get("dse") is not None:
        what = f"ffn {src['ffn']!r}" if src.get("ffn", "dense") != "dense" else "a DSE memory"
        raise ConfigError(f"{where}: key 'insert.from': {ins['from']!r} has {what}; expected a dense variant "
                          "(the insertion builds the STEM tables from its dense up-projections)")


def _check_variant_names(cfg: dict, origin: str):
    """Every variant the config names is one of config/variants.yaml (the schema checks only their spelling)."""
    known = variants(cfg)
    named = [(f"matrix.{s}.variants", v) for s, m in cfg["matrix"].items() for v in m["variants"]]
    named += [(f"variant_overrides.{v}", v) for v in cfg.get("variant_overrides") or {}]
    named += [(f"analysis.{a}.baseline", spec["baseline"]) for a, spec in (cfg.get("analysis") or {}).items()
              if isinstance(spec, dict) and "baseline" in spec]
    for key, v in named:
        if v not in known:
            raise ConfigError(f"{origin}: key '{key}': {v!r} is not a variant of config/variants.yaml; expected one "
                              f"of {', '.join(known)}")


def _cross_check(cfg: dict, origin: str):
    _check_variant_names(cfg, origin)
    _check_sources(cfg, origin)
    _check_suite_kinds(cfg, origin)
    _check_long_context(cfg, origin)
    _check_registered(cfg, origin)
    for name, spec in variants(cfg).items():
        if "optim" in spec:   # a variant's optim keys are merged over the experiment's: the same schema
            _check_variant_optim(cfg, name, spec["optim"], origin)
        if spec.get("dse") is not None:   # DSE orders, heads, widths: checked here, not when a job builds it
            _check_variant_dse(name, spec["dse"], origin)
        if spec.get("insert") is not None:   # likewise a mid-training insertion's source and init
            _check_variant_insert(cfg, name, spec, origin)
        kind = spec.get("ffn", "dense")
        if kind not in FFN_KINDS:
            raise ConfigError(f"{origin}: variant '{name}' (config/variants.yaml + variant_overrides): key 'ffn': "
                              f"{kind!r} is not a registered FFN kind; expected one of {', '.join(FFN_KINDS)}")
    for scale, m in cfg["matrix"].items():
        for what in ("archs", "tokenizer"):
            if scale not in cfg[what]:
                raise ConfigError(f"{origin}: key '{what}.{scale}' missing (scale {scale} is in the matrix)")
        for stage in m["stages"]:
            spec = cfg["stages"].get(stage, {}).get(scale)
            if spec is None:
                raise ConfigError(f"{origin}: key 'stages.{stage}.{scale}' missing (listed in matrix.{scale}.stages)")
            where = f"stages.{stage}.{scale}"
            total = sum(spec["data"].values())
            if not math.isclose(total, 1.0, abs_tol=1e-6):
                raise ConfigError(f"{origin}: key '{where}.data': mixture weights sum to {total:g}, expected 1")
            if spec["batch_size"] % spec["micro_batch"]:
                raise ConfigError(f"{origin}: key '{where}.micro_batch': {spec['micro_batch']} does not divide "
                                  f"batch_size {spec['batch_size']}")
            init = spec.get("init_from")
            if isinstance(init, dict) and spec.get("reset_optimizer") is False:
                raise ConfigError(f"{origin}: key '{where}.reset_optimizer': false needs a stage's optimizer state; "
                                  f"init_from {init} is a transformers checkpoint (it has none)")
            if isinstance(init, dict):
                pass   # {hf: ...}: a transformers checkpoint, checked against the arch when the job starts
            elif init is not None and (init not in m["stages"] or m["stages"].index(init) >= m["stages"].index(stage)):
                raise ConfigError(f"{origin}: key '{where}.init_from': {init!r} must be an earlier stage of "
                                  f"matrix.{scale}.stages {m['stages']}")
            if init is None and spec.get("reset_optimizer") is False:
                raise ConfigError(f"{origin}: key '{where}.reset_optimizer': false needs an init_from stage "
                                  "whose optimizer state it carries")
            max_len = spec.get("max_seq_len", cfg["archs"][scale]["max_seq_len"])
            for v in m["variants"]:   # a mid-training insertion starts from a matrix variant's earlier stage
                vspec = variant(cfg, v) or {}
                ins, v_init = vspec.get("insert"), {**spec, **(vspec.get("stage") or {})}.get("init_from")
                if ins and ins["stage"] == stage and (not v_init or (not isinstance(v_init, dict)
                                                                      and ins["from"] not in m["variants"])):
                    raise ConfigError(f"{origin}: key 'matrix.{scale}.variants': {v} is inserted into "
                                      f"{ins['from']!r} at {stage}; expected {ins['from']!r} in the matrix and "
                                      f"stages.{stage}.{scale}.init_from an earlier stage (or {{hf: ...}})")
            if spec["seq_len"] > max_len:
                raise ConfigError(f"{origin}: key '{where}.seq_len': {spec['seq_len']} exceeds the model's "
                                  f"max_seq_len {max_len} (set max_seq_len and a rope_scaling for the stage)")
        tok = cfg["tokenizer"][scale]
        if tok["kind"] == "train_bpe":
            for key in ("sources", "vocab_size"):
                if key not in tok:
                    raise ConfigError(f"{origin}: key 'tokenizer.{scale}.{key}' missing (needed by kind train_bpe)")
            if tok["vocab_size"] > cfg["archs"][scale]["vocab_size"]:
                raise ConfigError(f"{origin}: key 'tokenizer.{scale}.vocab_size': {tok['vocab_size']} exceeds "
                                  f"archs.{scale}.vocab_size {cfg['archs'][scale]['vocab_size']}")
        elif "path" not in tok:
            raise ConfigError(f"{origin}: key 'tokenizer.{scale}.path' missing (needed by kind pretrained)")
    cluster = cfg.get("cluster") or {}
    if cluster.get("fit_memory") and cluster.get("gpu_mem_gib") is None:
        raise ConfigError(f"{origin}: key 'cluster.fit_memory': true fits each training job to cluster.gpu_mem_gib; "
                          "expected cluster.gpu_mem_gib set (GiB per GPU)")
    if cluster.get("tables") == "host":   # one host's memory holds the tables: jobs of one GPU (ParallelPlan.of)
        for scale, t in (cluster.get("train") or {}).items():
            if t.get("nodes", 1) * t.get("gpus_per_node", 1) > 1:
                raise ConfigError(f"{origin}: key 'cluster.tables': host keeps the tables in one host's memory, for "
                                  f"jobs of one GPU; cluster.train.{scale} gives {t.get('nodes', 1)} x "
                                  f"{t.get('gpus_per_node', 1)} GPUs (expected rows or fsdp)")
    if cfg.get("sweeps"):   # the DSE paper's Sec. 3 sweeps: every point builds, within tolerance
        sweeps.validate(cfg, origin)


# ---- variants and models -------------------------------------------------------------------------
def variant_spec(cfg: dict, variant: str) -> dict:
    """A variant's spec: one of config/variants.yaml (with variant_overrides), or a point of the config's
    ``sweeps:`` section (stem.sweeps: ``rho_0p75``, ``slots_4096``; its ``stage`` key holds the stage settings
    it overrides)."""
    all_variants = variants(cfg)
    base, k = seeds.split(variant)   # a seed of a matrix cell (stem.seeds): the variant's own spec
    if k and base in all_variants:
        return all_variants[base]
    if variant in all_variants:
        return all_variants[variant]
    if cfg.get("sweeps") and sweeps.is_sweep_id(variant):
        points = sweeps.variant_specs(cfg)
        if variant in points:
            return points[variant]
        raise ConfigError(f"variant {variant!r}: not a point of the config's sweeps: section (expected one of "
                          f"{', '.join(points)})")
    raise ConfigError(f"variant {variant!r}: expected one of {sorted(all_variants)}")


def _presentation(cfg: dict | None, key: str) -> dict:
    """{variant: its ``key`` (label, figure_label, color) or None}, variant_overrides over config/variants.yaml,
    in that file's order; read without copying the variants (the report asks per label)."""
    over = (cfg or {}).get("variant_overrides") or {}
    return {name: (over.get(name) or {}).get(key, spec.get(key)) for name, spec in variants_file().items()}


def variant_labels(cfg: dict | None = None) -> dict[str, str]:
    """{variant: its row label} in config/variants.yaml's order (each variant's ``label:``, the one source;
    with ``cfg``'s variant_overrides): the tables' rows and their order, the figures' legends."""
    return {name: label or name for name, label in _presentation(cfg, "label").items()}


def variant_figure_labels(cfg: dict | None = None) -> dict[str, str]:
    """{variant: its figures' legend label}: ``figure_label:`` where a variant sets one, else its ``label:``."""
    return {name: fig or label for (name, fig), label in
            zip(_presentation(cfg, "figure_label").items(), variant_labels(cfg).values())}


def variant_colors(cfg: dict | None = None) -> dict[str, str]:
    """{variant: its figures' colour} for the variants whose config/variants.yaml entry sets ``color:`` (the
    others are drawn in matplotlib's colour cycle)."""
    return {name: color for name, color in _presentation(cfg, "color").items() if color}


def model_config_for(cfg: dict, scale: str, variant: str, stage: str | None = None):
    arch = dict(cfg["archs"][scale])
    if stage is not None:
        spec = cfg["stages"][stage][scale]
        for key in ("max_seq_len", "rope_scaling"):
            if key in spec:
                arch[key] = spec[key]
    spec = {k: v for k, v in variant_spec(cfg, variant).items() if k != "stage"}
    return model_config(arch, spec)


# ---- paths: stem.layout ------------------------------------------------------------------------
# Keys of a source that steer its tokenize jobs rather than describe its documents.
TOKENIZE_KEYS = ("max_tokens", "parts", "doc_keys", "sample", "val_fraction")


def source_of(cfg: dict, source: str) -> dict:
    """The config's ``sources.<source>``; a source it does not define (e.g. a target path naming one) is one line
    naming it and the defined ones."""
    if source not in cfg["sources"]:
        raise ConfigError(f"source {source!r}: not defined in the {cfg['experiment']} config's sources; expected one "
                          f"of {sorted(cfg['sources'])}")
    return cfg["sources"][source]


def source_parts(cfg: dict, source: str) -> int:
    """How many scattered tokenize jobs a source is split into (`parts`, default 1)."""
    return int(source_of(cfg, source).get("parts", 1))


def part_names(cfg: dict, source: str) -> list[str]:
    return list(_part_names(source_parts(cfg, source)))


@lru_cache(maxsize=None)
def _part_names(n: int) -> tuple[str, ...]:
    return tuple(f"part{k:05d}-of-{n:05d}" for k in range(n))


def part_index(cfg: dict, source: str, part: str) -> tuple[int, int]:
    """(k, n) of a part name of a source; a one-line error for a name that is not one of its parts."""
    n = source_parts(cfg, source)
    k = int(part[4:9]) if len(part) == 18 and part.startswith("part") else -1
    if not (0 <= k < n and part == _part_names(n)[k]):
        raise ConfigError(f"source {source!r}: part {part!r} is not one of its {n} parts")
    return k, n


# ---- job specs -----------------------------------------------------------------------------------
def variant_stages(cfg: dict, name: str, stages: list[str]) -> list[str]:
    """The stages a variant trains: all, except for a mid-training insertion (``insert:``), which starts at
    ``insert.stage`` (from another variant's checkpoint of the stage before)."""
    ins = (variant(cfg, name) or {}).get("insert")
    return list(stages[stages.index(ins["stage"]):]) if ins and ins["stage"] in stages else list(stages)


def train_targets(cfg: dict) -> list[tuple[str, str, str]]:
    return [(scale, v, stage) for scale, m in cfg["matrix"].items() for v in m["variants"]
            for stage in variant_stages(cfg, v, m["stages"])]


def seed_targets(cfg: dict) -> list[tuple[str, str, str]]:
    """The training jobs of seeds beyond the matrix's own (stem.seeds): (scale, '{variant}_seed{k}', stage)."""
    return [(scale, seeds.seed_id(v, k), stage) for scale, m in cfg["matrix"].items() for v in m["variants"]
            for k in seeds.seeds_of(cfg, scale, v) if k for stage in variant_stages(cfg, v, m["stages"])]


def train_job(cfg: dict, scale: str, variant: str, stage: str):
    """The fully resolved, checked spec of one training job (a stem.specs.TrainSpec)."""
    base, k = seeds.split(variant)
    if k:   # seed k of a matrix cell (stem.seeds): the cell's spec, its own seed and folder
        if k not in seeds.seeds_of(cfg, scale, base):
            raise ConfigError(f"variant {variant!r}: seed {k} of {base!r} at {scale} is not asked for by the "
                              f"{cfg['experiment']} config (seeds: {seeds.seeds_of(cfg, scale, base)})")
        d = train_job(cfg, scale, base, stage).to_dict()
        init = d.get("init_stage")
        return TrainSpec.from_dict({**d, "variant": variant, "seed": cfg["seed"] + k,
                                    "out_dir": stage_dir(cfg["experiment"], scale, variant, stage),
                                    "init_from": checkpoint(cfg["experiment"], scale, variant, init) if init else None})
    exp = cfg["experiment"]
    point = is_sweep_id(variant)   # a sweep point: trained at sweeps.scale / sweeps.stage, matrix or not
    if not point and (scale not in cfg["matrix"] or stage not in cfg["matrix"][scale]["stages"]):
        raise ConfigError(f"stage {stage!r} at scale {scale!r} is not in the {exp} experiment's matrix")
    if not point and stage not in variant_stages(cfg, variant, cfg["matrix"][scale]["stages"]):
        raise ConfigError(f"variant {variant!r}: inserted at stage {variant_spec(cfg, variant)['insert']['stage']!r}; "
                          f"it has no {stage!r} stage of its own")
    sw = cfg.get("sweeps") or {}
    if point and (scale, stage) != (sw.get("scale"), sw.get("stage")):
        raise ConfigError(f"variant {variant!r}: a sweep point, trained at sweeps.scale / sweeps.stage "
                          f"({sw.get('scale')} / {sw.get('stage')}), not at {scale} / {stage}")
    vspec = variant_spec(cfg, variant)
    st = {**cfg["stages"][stage][scale], **vspec.get("stage", {})}   # a sweep point's settings (sweeps.train)
    init = st.pop("init_from", None)
    data = st.pop("data")
    table_group = st.pop("table_group", None)   # this stage's table-group LR multiplier / weight decay
    ins = vspec.get("insert") if not point and stage == (vspec.get("insert") or {}).get("stage") else None
    if ins is not None and (not init or st.get("reset_optimizer") is False):
        raise ConfigError(f"variant {variant!r}: insert.stage {stage!r} needs stages.{stage}.{scale}.init_from (an "
                          "earlier stage of the dense variant, or {hf: ...}) and a fresh optimizer (reset_optimizer: true)")
    for key in ("max_seq_len", "rope_scaling"):
        st.pop(key, None)
    train = {**TRAIN_DEFAULTS, **cfg.get("train", {}), **st}
    # reset_optimizer (default true): false carries the optimizer state of init_from's stage, which then
    # saves it in its checkpoint (checkpoint/optimizer/)
    train["reset_optimizer"] = bool(st.get("reset_optimizer", True)) if init else True
    train["save_optimizer"] = not point and any(cfg["stages"][s][scale].get("init_from") == stage
                                                and not cfg["stages"][s][scale].get("reset_optimizer", True)
                                                for s in cfg["matrix"][scale]["stages"])
    train["parallel"] = (cfg.get("cluster") or {}).get("strategy", "fsdp")   # the backbone's, under torchrun
    train["tables"] = (cfg.get("cluster") or {}).get("tables", "fsdp")       # the lookup tables', likewise
    if (cfg.get("cluster") or {}).get("fit_memory"):   # the plan picks a micro-batch / checkpointing / host tables that fit
        train["fit_gib"] = cfg["cluster"]["gpu_mem_gib"]
    optim = _deep_merge(cfg["optim"], vspec.get("optim", {}))   # a variant may set e.g. table_update
    if table_group:
        optim = _deep_merge(optim, {"groups": {"table": table_group}})
    extra = {} if ins is None else {"insert": {"from": ins["from"], "init": ins.get("init", "projected")}}
    return TrainSpec.from_dict({**extra,
        "experiment": exp, "scale": scale, "variant": variant, "stage": stage,
        "seed": cfg["seed"], "device": cfg["device"],
        "model": model_config_for(cfg, scale, variant, stage).to_dict(),
        "optim": optim,
        "train": train,
        "data": {src: {"weight": w, "manifest": tokens_manifest(exp, scale, src)} for src, w in data.items()},
        "tokenizer": tokenizer_path(exp, scale),
        "init_from": (HF_PREFIX + init["hf"] + (GGUF_SEP + init["gguf_file"] if init.get("gguf_file") else "")
                      if isinstance(init, dict)   # a transformers checkpoint (stem.hf), or a GGUF file in it
                      else checkpoint(exp, scale, ins["from"] if ins else variant, init) if init else None),
        "init_stage": None if isinstance(init, dict) else init,
        "out_dir": stage_dir(exp, scale, variant, stage),
        **plugins.spec_key(cfg),
    })


def train_spec(cfg: dict, scale: str, variant: str, stage: str) -> dict:
    """The JSON form of ``train_job``: what the train rule passes to its job (``--spec``)."""
    return train_job(cfg, scale, variant, stage).to_dict()


def corpus_spec(cfg: dict, source: str) -> dict:
    src = source_of(cfg, source)
    if src["kind"] != "synth":
        raise ConfigError(f"source {source!r}: no corpus to generate (only kind 'synth' sources have one)")
    return {"source": source, "world": cfg.get("world", {}), "seed": cfg["seed"], **src, **plugins.spec_key(cfg)}


def documents_spec(cfg: dict, source: str) -> dict:
    """The reader spec of a source's documents (a synth source is read back from its corpus file)."""
    src = source_of(cfg, source)
    if src["kind"] == "synth":
        return {"kind": "files", "paths": [corpus_path(cfg["experiment"], source)], "format": "jsonl"}
    return {k: v for k, v in src.items() if k not in TOKENIZE_KEYS}


def source_inputs(cfg: dict, source: str) -> list[str]:
    return [corpus_path(cfg["experiment"], source)] if source_of(cfg, source)["kind"] == "synth" else []


def tokenizer_spec(cfg: dict, scale: str) -> dict:
    tok = dict(cfg["tokenizer"][scale])
    if tok["kind"] == "train_bpe":
        tok["documents"] = [documents_spec(cfg, s) for s in tok["sources"]]
    return tok


def tokenize_spec(cfg: dict, scale: str, source: str, part: str | None = None) -> dict:
    """Spec of one tokenize job: part k of n of a source (``part`` as named by ``part_names``).
    ``max_tokens`` is split evenly over the parts; ``sample`` is a [lo, hi) range of the per-document
    uniform (or a mapping scale -> range), see stem.data.shards.tokenize_to_shards."""
    src = source_of(cfg, source)
    k, n = part_index(cfg, source, part or _part_names(source_parts(cfg, source))[0])
    sample = src.get("sample")
    if isinstance(sample, dict):
        if scale not in sample:
            raise ConfigError(f"key 'sources.{source}.sample': no range for scale {scale!r} (have {sorted(sample)})")
        sample = sample[scale]
    if sample is not None and src.get("doc_keys", "index") != "content":
        raise ConfigError(f"key 'sources.{source}.sample' needs doc_keys: content (a document's position "
                          "depends on how the source is split into parts)")
    max_tokens = src.get("max_tokens")
    return {"documents": documents_spec(cfg, source), "seed": cfg["seed"],
            "max_tokens": None if max_tokens is None else -(-int(max_tokens) // n),
            "vocab_size": cfg["archs"][scale]["vocab_size"], "part": [k, n],
            "doc_keys": src.get("doc_keys", "index"), "sample": sample,
            # the held-out share of documents (stem.data.shards.val_mask; only where the source sets it, so the
            # other experiments' job specs stay as they were)
            **({"val_fraction": src["val_fraction"]} if "val_fraction" in src else {})}
