"""The knowledge experiment's points (config ``knowledge:``; docs/knowledge.md): torch-free, for the DAG.

Each point is one training job, a generated variant id ``k__{source}__{variant}`` (seed k > 0:
``k__{source}__{variant}__s{k}``): the variant of config/variants.yaml (with variant_overrides) trained by the
ordinary train rule at ``knowledge.scale`` / ``knowledge.stage`` on one bios source only (stem.data.bios: a
world of ``n`` individuals, each seen ``exposures`` times), for one pass over it (the steps follow from N, E and
the measured ``knowledge.tokens_per_bio``), with the job spec's seed = the config's seed + k. Its checkpoint gets
the ``knowledge`` analysis (stem.analysis.knowledge); the report's ``knowledge`` table and ``knowledge_bits``
figure read them (stem.report.knowledge). This module reads the typed tree by attribute (it sits below it).
"""
from __future__ import annotations

import dataclasses
import math
import re

from stem import layout as L
from stem.data.bios import pair_pool, template_problem  # noqa: F401 (template_problem: for stem.config.experiment)
from stem.fields import FieldError
from stem.options import NameKind, values

ID = re.compile(r"^k__(?P<source>[a-z][a-z0-9_]*?)__(?P<variant>[a-z][a-z0-9_]*?)(?:__s(?P<k>[1-9][0-9]*))?$")
ANALYSIS = "knowledge"
EDIT = "knowledge_edit"   # analysis.knowledge_edit: {pairs, collateral, seed, sources}: the points it edits


def point_id(source: str, variant: str, k: int = 0) -> str:
    return f"k__{source}__{variant}" + (f"__s{k}" if k else "")


def is_point(name: str) -> bool:
    return bool(ID.match(name))


def split(name: str) -> tuple[str, str, int]:
    """(source, variant, seed index) of a point id."""
    m = ID.match(name)
    if not m:
        raise ValueError(f"{name!r} is not a knowledge point id (k__{{source}}__{{variant}}[__s{{k}}])")
    return m["source"], m["variant"], int(m["k"] or 0)


def _reader(exp, source: str) -> dict:
    return exp.sources[source].reader


def world_size(exp, source: str) -> int:
    return int(_reader(exp, source)["n"])


def points(exp) -> list[str]:
    """Every point of the config's knowledge sweep (sources x variants x seeds; ``variants_at``: a source's own
    variants; ``seeds_at``: the sources whose points get every seed, ``seeds_for``: the variants that get them
    there; the others seed 0 only)."""
    kn = exp.knowledge
    if kn is None:
        return []
    out = []
    for source in kn.sources:
        at = kn.seeds_at is None or source in kn.seeds_at
        out += [point_id(source, v, k) for v in variants_at(exp, source)
                for k in (kn.seeds if at and (kn.seeds_for is None or v in kn.seeds_for) else (0,))]
    return out


def variants_at(exp, source: str) -> tuple[str, ...]:
    """A source's variants: its ``knowledge.variants_at`` entry, else ``knowledge.variants``."""
    kn = exp.knowledge
    return (kn.variants_at or {}).get(source, kn.variants)


def steps(exp, source: str) -> int:
    """One pass over the source (N x E biographies of ``tokens_per_bio`` tokens, ``pair_tokens_per_bio`` with pair
    names, in batches of the stage's), at least ``knowledge.min_steps`` (a small world gets more passes, the loader
    cycling over its windows)."""
    kn, r = exp.knowledge, _reader(exp, source)
    st = exp.stages[kn.stage][kn.scale]
    batch, seq_len = (train_settings(exp).get(k, getattr(st, k)) for k in ("batch_size", "seq_len"))
    per_bio = (kn.pair_tokens_per_bio if name_kind(exp, source) == NameKind.PAIR else None) or kn.tokens_per_bio
    return max(kn.min_steps, math.ceil(int(r["n"]) * int(r["exposures"]) * per_bio / (batch * seq_len)))


def train_settings(exp) -> dict:
    """The stage settings every point sets over its stage's (``knowledge.train``; none: the stage's own)."""
    return exp.knowledge.train.settings() if exp.knowledge.train else {}


def variant_spec(exp, name: str):
    """A point's Variant (stem.specs.Variant): its base variant's, with the stage settings it overrides (``stage``:
    ``knowledge.train``'s, its source alone, its steps) and its seed index (``seed_index``)."""
    source, variant, k = split(name)
    if name not in points(exp):
        raise ValueError(f"variant {name!r}: not a point of the config's knowledge: section")
    base = exp.variant(variant)
    return dataclasses.replace(base, stage={**(base.stage or {}), **train_settings(exp), "data": {source: 1.0},
                                            "steps": steps(exp, source)}, seed_index=k)


def targets(exp) -> list[str]:
    """Every point's training summary and knowledge analysis (rule all)."""
    kn = exp.knowledge
    if kn is None:
        return []
    edit = (exp.analysis.plugins.get(EDIT) if exp.analysis else None) or {}
    out = [f for p in points(exp) for f in (L.summary(exp.experiment, kn.scale, p, kn.stage),
                                            L.analysis_json(exp.experiment, kn.scale, p, kn.stage, ANALYSIS))]
    return out + [L.analysis_json(exp.experiment, kn.scale, p, kn.stage, EDIT) for p in points(exp)
                  if split(p)[0] in (edit.get("sources") or ())]


def validate(exp):
    """The knowledge section against the rest of the tree (one FieldError naming the key): its sources are bios
    sources of at most ``names`` individuals with whole positive ``n`` and ``exposures``, its variants known
    (no ``__`` in a name), its scale/stage defined and trained from scratch, its tokenizer (``knowledge.tokenizer``)
    adds the names, the points' vocabulary holds them."""
    kn = exp.knowledge
    for i, source in enumerate(kn.sources):
        src = exp.sources.get(source)
        key = f"knowledge.sources[{i}]"
        _fail(src is not None and src.generator == "bios", key, f"{source!r}; expected a source of generator bios")
        _fail("__" not in source, key, f"{source!r}; expected a name without '__'")
        r = src.reader
        for what in ("n", "exposures"):
            v = r.get(what)
            _fail(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"sources.{source}.{what}",
                  f"{v!r}; expected an integer >= 1")
        _fail(r["exposures"] >= kn.min_exposures, f"sources.{source}.exposures",
              f"{r['exposures']}; expected at least knowledge.min_exposures ({kn.min_exposures}: a smaller budget "
              "does not learn the smallest world, docs/knowledge.md)")
        _fail(r["n"] <= kn.names, f"sources.{source}.n", f"{r['n']} individuals; expected at most knowledge.names "
              f"({kn.names}, the name vocabulary)")
        _fail(r.get("name_kind", NameKind.ONE) in values(NameKind), f"sources.{source}.name_kind",
              f"{r.get('name_kind')!r}; expected one of {', '.join(values(NameKind))}")
        _fail(name_kind(exp, source) != NameKind.ONE or r["n"] <= name_tokens(exp), f"sources.{source}.n",
              f"{r['n']} individuals with one-token names; expected at most knowledge.name_tokens "
              f"({name_tokens(exp)}, the names that are tokens)")
    for v in kn.variants:
        _fail(exp.variant(v) is not None and "__" not in v, "knowledge.variants",
              f"{v!r}; expected variants of config/variants.yaml (without '__')")
    edit = (exp.analysis.plugins.get(EDIT) if exp.analysis else None) or {}
    for s in edit.get("sources") or ():
        _fail(s in kn.sources and exp.sources[s].reader.get("name_kind", kn.name_kind) == NameKind.ONE,
              f"analysis.{EDIT}.sources", f"{s!r}; expected one-token sources of knowledge.sources")
    _check_inject(exp, edit)
    for s in kn.seeds_at or ():
        _fail(s in kn.sources, "knowledge.seeds_at", f"{s!r}; expected sources of knowledge.sources")
    for v in kn.seeds_for or ():
        _fail(v in kn.variants, "knowledge.seeds_for", f"{v!r}; expected variants of knowledge.variants")
    for s, vs in (kn.variants_at or {}).items():
        _fail(s in kn.sources, "knowledge.variants_at", f"{s!r}; expected sources of knowledge.sources")
        _fail(bool(vs) and set(vs) <= set(kn.variants), f"knowledge.variants_at.{s}",
              f"{list(vs)!r}; expected a non-empty list of variants of knowledge.variants")
    scale, stage = kn.scale, kn.stage
    settings = exp.stages.get(stage, {}).get(scale)
    _fail(scale in exp.archs, "knowledge.scale", f"{scale!r}; expected a scale with archs")
    _fail(settings is not None and settings.init_from is None, "knowledge.stage",
          f"{stage!r} at {scale}; expected a stage of stages.*.{scale} trained from scratch (init_from: null)")
    _check_names(exp)


def name_tokens(exp) -> int:
    """How many of the pool's names are one token (``knowledge.name_tokens``, default every name)."""
    return exp.knowledge.name_tokens or exp.knowledge.names


def _name_tokens_key(exp) -> str:
    """The key ``name_tokens`` reads, for an error message."""
    return "knowledge.name_tokens" if exp.knowledge.name_tokens else "knowledge.names"


def name_kind(exp, source: str) -> str:
    """A source's name kind (its own ``name_kind``, else the knowledge section's)."""
    return _reader(exp, source).get("name_kind", exp.knowledge.name_kind)


def capacity_sources(exp) -> list[str]:
    """The capacity sweep: the sources of ``knowledge.capacity_names``' kind, by N."""
    kn = exp.knowledge
    return sorted((s for s in kn.sources if name_kind(exp, s) == kn.capacity_names), key=lambda s: world_size(exp, s))


def _check_names(exp):
    """The tokenizer adds the names (one-token names; pair's pools where a source has pair names), the points'
    vocabulary holds them, pair's pools give every individual a name, the capacity sweep has a source."""
    kn, tok = exp.knowledge, exp.knowledge.tokenizer
    _fail(name_tokens(exp) <= kn.names, "knowledge.name_tokens",
          f"{kn.name_tokens}; expected at most knowledge.names ({kn.names})")
    pairs = any(name_kind(exp, s) == NameKind.PAIR for s in kn.sources)
    _fail(bool(tok.add_names) or (kn.name_kind != NameKind.ONE and not pairs), "knowledge.tokenizer.add_names",
          f"{tok.add_names!r}; expected true (one-token names and pair names' pools are tokens of their own)")
    pool = kn.pair_pool or pair_pool(kn.names)
    _fail(not pairs or pool * pool >= kn.names, "knowledge.pair_pool",
          f"{pool} words a side ({pool * pool} pair names); expected at least knowledge.names ({kn.names})")
    if tok.add_names and tok.vocab_size:
        key = "knowledge.vocab_size" if kn.vocab_size else f"archs.{kn.scale}.vocab_size"
        need = tok.vocab_size + name_tokens(exp) + (2 * pool if pairs else 0)
        _fail(need <= vocab_size(exp), key, f"{vocab_size(exp)}; expected at least knowledge.tokenizer.vocab_size "
              f"+ {_name_tokens_key(exp)}{' + 2 x pair_pool' if pairs else ''} = {need}")
    _fail(bool(capacity_sources(exp)), "knowledge.capacity_names",
          f"{str(kn.capacity_names)!r}; expected the name kind of a source of knowledge.sources")


def vocab_size(exp) -> int:
    """The points' vocabulary: ``knowledge.vocab_size``, else the scale's (the rest of the architecture is the
    scale's)."""
    return exp.knowledge.vocab_size or exp.archs[exp.knowledge.scale].vocab_size


def _check_inject(exp, edit: dict):
    """``analysis.knowledge_edit.inject`` (people, steps, docs, lr): positive, and every edited world leaves
    ``people`` held-out names in the pool (the individuals after its N)."""
    inj = edit.get("inject")
    if inj is None:
        return
    key = f"analysis.{EDIT}.inject"
    _fail(isinstance(inj, dict) and set(inj) == {"people", "steps", "docs", "lr"}, key,
          f"{inj!r}; expected a mapping of people, steps, docs, lr")
    for k in ("people", "steps", "docs"):
        v = inj[k]
        _fail(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{key}.{k}",
              f"{v!r}; expected an integer >= 1")
    _fail(isinstance(inj["lr"], (int, float)) and inj["lr"] > 0, f"{key}.lr", f"{inj['lr']!r}; expected a number > 0")
    for s in edit.get("sources") or ():
        room = name_tokens(exp) - world_size(exp, s)
        _fail(inj["people"] <= room, f"{key}.people", f"{inj['people']}; expected at most {_name_tokens_key(exp)} - N = "
              f"{room} "
              f"at {s} (the held-out individuals are the pool's after the world's N)")


def _fail(ok: bool, key: str, problem: str):
    if not ok:
        raise FieldError(key, problem)
