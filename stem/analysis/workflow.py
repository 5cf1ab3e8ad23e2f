"""The analyze stage in the DAG: targets, job specs and inputs from the experiment config's ``analysis:``.

    analysis:
      stages: {350m: [pretrain], 1b: [extend]}     # which trained checkpoints are analysed
      editing:  {...}                               # one key per analysis (absent = not run); its own
                                                    #   stages: {...} replaces `stages` for it
      heaps:    {source: web, lengths: [...], windows: 8}
      spread:   {source: web, n_tokens: 256}
      capacity: {source: web, countries: 40, people: 60, choices: 10, seed: 0}   # needs the synthetic world
      logitlens: {source: web, windows: 8, seq_len: 128, baseline: dense}        # DSE models only, with
      cka: {source: web, tokens: entities, ..., baseline: dense}                  #   their baseline's checkpoint
      dse_disabled: {suite: commonsense, categories: {...}, modes: [disabled, forced]}

One job per (checkpoint, analysis): ``results/{experiment}/{scale}/{variant}/{stage}/analysis/{name}.json``.
Every analysis is an ``Analysis`` registered by name in ``stem.registry.ANALYSES`` (the built-in ones at the
end of this module, as a plugin module registers its own, stem.plugins); its config key ``analysis.{name}``
turns it on. This module imports no torch (Snakemake builds the DAG with it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

from stem import config as C
from stem.config import experiment as E
from stem import knowledge as K
from stem import layout as L
from stem import plugins
from stem.analysis import dse_disabled   # torch-free module (its imports sit in its functions)
from stem.config.experiment import Experiment
from stem.models.spec import ModelConfig
from stem.models.registry import ffn_facts, param_roles
from stem.registry import ANALYSES


@dataclass(frozen=True)
class Analysis:
    """One analysis of a checkpoint.

    run: ``run(ckpt_dir, spec) -> result fields`` or its ``"module:function"`` (imported by the job only).
    needs_world: run only when the config has a synthetic ``world:`` (the job spec carries it).
    uses_world: the job spec carries the config's ``world:`` when there is one.
    baseline: compares the model with its baseline: the checkpoint of the same experiment/scale/stage's
        ``analysis.{name}.baseline`` variant (default dense) is an input of the job (``baseline_checkpoint``).
    only_for(kind) -> whether a checkpoint gets it by default (``model_kind``'s mapping); None: every one.
    resolve(exp, spec): completes the job spec from the experiment config's typed tree (in place), e.g. adds
        input files under keys ``rule_inputs`` reads (manifest, corpus, facts).
    """
    run: Callable | str
    needs_world: bool = False
    uses_world: bool = False
    baseline: bool = False
    only_for: Callable | None = None
    resolve: Callable | None = None


def analysis(name: str, **kw):
    """Decorator: register ``run(ckpt_dir, spec)`` as analysis ``name`` (keywords: Analysis's fields)."""
    return ANALYSES.register(name, lambda run: Analysis(run, **kw))


def settings(exp: Experiment, name: str) -> dict:
    """``analysis.{name}`` as the config writes it (a built-in's node as its mapping, a plugin's section as
    written); empty when the config does not set it."""
    section = exp.analyses().get(name)
    return E.dataclass_mapping(section) if section is not None else {}


def analyses(exp: Experiment) -> list[str]:
    a = exp.analyses()
    return [n for n in ANALYSES if a.get(n) is not None and (not ANALYSES[n].needs_world or exp.world)]


def stages(exp: Experiment, name: str | None = None) -> dict:
    """{scale: [stage]} whose checkpoints analysis ``name`` reads: its own ``analysis.{name}.stages``, else
    ``analysis.stages``."""
    return (settings(exp, name).get("stages") if name else None) or (exp.analysis and exp.analysis.stages) or {}


def checkpoints(exp: Experiment) -> list[tuple[str, str, str]]:
    """The trained checkpoints some analysis reads."""
    by_name = [stages(exp)] + [stages(exp, n) for n in analyses(exp)]
    return [(s, v, st) for s, v, st in C.train_targets(exp) if any(st in (b.get(s) or []) for b in by_name)]


def _model_json(exp: Experiment, scale: str, variant: str) -> str:
    """The variant's model config (its FFN kinds; any stage: a mid-training insertion has no pretraining) as JSON."""
    return json.dumps(C.model_config_for(exp, scale, variant).to_dict(), sort_keys=True)


def has_tables(exp: Experiment, scale: str, variant: str) -> bool:
    """Whether the variant's model declares a token-indexed (STEM) table."""
    return model_kind(exp, scale, variant)["tables"]


def model_kind(exp: Experiment, scale: str, variant: str) -> dict:
    """{tables: a STEM table (token-indexed rows), lookups: any lookup-role parameter (STEM or DSE tables),
    dse: a DSE memory, variant, baseline: the experiment's baseline variant (stem.config.baseline_variant)}: what
    decides the default analyses of a checkpoint."""
    return {**_kind(_model_json(exp, scale, variant)), "variant": variant,
            "baseline": variant == E.baseline_variant(exp.variant_overrides)}


@lru_cache(maxsize=None)
def _kind(model_json: str) -> dict:
    """From the FFN kinds' registered facts (stem.models.registry.FFNFacts, torch-free; every model build checks
    them against the modules); a kind registered without them: from the model built on the meta device."""
    cfg = ModelConfig.from_dict(json.loads(model_json))
    facts = [ffn_facts(k) for k in sorted(set(cfg.ffn))]
    if all(f.table is not None and f.lookup is not None for f in facts):
        return {"tables": any(f.table for f in facts), "lookups": any(f.lookup for f in facts) or bool(cfg.dse and cfg.dse.layers),
                "dse": cfg.dse is not None}
    return _built_kind(model_json)


def _built_kind(model_json: str) -> dict:
    """``_kind`` read from the model built on the meta device (torch)."""
    # torch: only for a kind registered without its facts (the DAG of the built-in kinds imports no torch)
    from stem.analysis.common import table_sites   # torch
    from stem.models.model import meta_model       # torch
    model = meta_model(model_json)
    lookups = any(r.count == "lookup" for r in param_roles(model).values())
    return {"tables": bool(table_sites(model)), "lookups": lookups, "dse": model.cfg.dse is not None}


def targets(exp: Experiment) -> list[str]:
    out, trained = [], set(C.train_targets(exp))
    for s, v, st in checkpoints(exp):
        kind = model_kind(exp, s, v)
        out += [L.analysis_json(exp.experiment, s, v, st, name) for name in analyses(exp)
                if st in (stages(exp, name).get(s) or []) and (ANALYSES[name].only_for or (lambda m: True))(kind)
                and (not ANALYSES[name].baseline or (s, baseline(exp, name), st) in trained)]
    return out


def baseline(exp: Experiment, name: str) -> str:
    """The baseline variant an analysis compares with (config ``analysis.{name}.baseline``, default the experiment's
    baseline, stem.config.baseline_variant)."""
    return settings(exp, name).get("baseline") or E.baseline_variant(exp.variant_overrides)


def job_spec(exp: Experiment, scale: str, variant: str, stage: str, name: str) -> dict:
    if name not in analyses(exp):
        raise ValueError(f"analysis {name!r}: not configured for experiment '{exp.experiment}' "
                         f"(config key 'analysis.{name}'); expected one of {analyses(exp)}")
    entry = ANALYSES[name]
    own = {k: x for k, x in settings(exp, name).items() if k != "stages"}   # stages: which jobs, not what they do
    spec = {**own, "analysis": name, "device": str(exp.device),
            "job": {"experiment": str(exp.experiment), "scale": scale, "variant": variant, "stage": stage}}
    if spec.get("facts"):  # a shipped prompt set: relative to the repository, wherever the workflow runs
        spec["facts"] = str(Path(C.REPO, spec["facts"])) if not Path(spec["facts"]).is_absolute() else spec["facts"]
    if exp.world and (entry.needs_world or entry.uses_world):
        spec["world"] = E.dataclass_mapping(exp.world)
    if entry.baseline:
        spec["baseline"] = baseline(exp, name)
        if (scale, spec["baseline"], stage) not in C.train_targets(exp):
            raise ValueError(f"analysis {name!r} of {scale}/{variant}/{stage}: key 'analysis.{name}.baseline' is "
                             f"{spec['baseline']!r}, which the {exp.experiment} matrix does not train at "
                             f"{scale}/{stage}")
        spec["baseline_checkpoint"] = L.checkpoint(exp.experiment, scale, spec["baseline"], stage)
    if "source" in spec:
        spec["manifest"] = C.tokens_manifest(exp.experiment, scale, spec["source"])
    if entry.resolve:
        entry.resolve(exp, spec)
    return {**spec, **plugins.spec_key(exp)}


def rule_inputs(exp: Experiment, scale: str, variant: str, stage: str, name: str) -> dict:
    spec = job_spec(exp, scale, variant, stage, name)
    inputs = {"checkpoint": L.checkpoint(exp.experiment, scale, variant, stage)}
    inputs.update({k: spec[k] for k in ("manifest", "corpus", "facts", "hf_export") if spec.get(k)})
    if spec.get("baseline_checkpoint"):
        inputs["baseline"] = spec["baseline_checkpoint"]
    if (spec.get("eval") or {}).get("fixtures"):
        inputs["fixtures"] = spec["eval"]["fixtures"]
    return inputs


# ---- the built-in analyses, registered as a plugin module registers its own (tests/plugins/toy_analysis.py) ----
# by their "module:function", so building the DAG imports no torch. The checkpoints each gets by default
# (any one can still be asked for by its path): Heaps' curve is the same for every model of a scale and only
# STEM's token-indexed tables make it a parameter count (|S| d_ff L_uniq), so only models with those (not DSE:
# its hashed N-gram tables read a constant number of rows per token, whatever the context); the held-out
# losses are compared with the dense baseline's (the loss direction of the STEM paper, and of the DSE paper's
# Table 1 for dse), so dense and models with lookup tables (STEM, DSE); the DSE paper's mechanism analyses
# (Sec. 6, App. G) only for models with a DSE memory; editing (the embedding rows as for dense: DSE has no
# per-token rows to edit), spread and capacity: every model.
def _has_dse(kind: dict) -> bool:
    return kind["dse"]


def _capacity_corpus(exp: Experiment, spec: dict):
    """The synthetic corpus whose fact counts bucket the capacity probe's items (an input of the job)."""
    spec["corpus"] = L.corpus_path(exp.experiment, spec["source"])


def _hf_export(exp: Experiment, spec: dict):
    """The checkpoint's export-hf folder (rules/hf.smk), which hf_parity scores under lm-eval's stock hf model."""
    j = spec["job"]
    spec["hf_export"] = L.hf_export(j["experiment"], j["scale"], j["variant"], j["stage"])


ANALYSES.add("editing", Analysis("stem.analysis.editing:run", uses_world=True))
ANALYSES.add("heaps", Analysis("stem.analysis.heaps:run", only_for=lambda kind: kind["tables"]))
ANALYSES.add("spread", Analysis("stem.analysis.spread:run"))
ANALYSES.add("capacity", Analysis("stem.analysis.capacity:run", needs_world=True, resolve=_capacity_corpus))
ANALYSES.add("heldout", Analysis("stem.analysis.heldout:run",
                                 only_for=lambda kind: kind["lookups"] or kind["baseline"]))
# the held-out loss of STEM inserted into a dense checkpoint at step 0 (placement x init; config/real.yaml)
ANALYSES.add("hf_parity", Analysis("stem.analysis.hf_parity:run", resolve=_hf_export))
ANALYSES.add("insertion_step0", Analysis("stem.analysis.insertion:run", only_for=lambda kind: kind["baseline"]))
ANALYSES.add("logitlens", Analysis("stem.analysis.logitlens:run", baseline=True, only_for=_has_dse))
ANALYSES.add("cka", Analysis("stem.analysis.cka:run", uses_world=True, baseline=True, only_for=_has_dse))
ANALYSES.add("dse_disabled", Analysis("stem.analysis.dse_disabled:run", uses_world=True, only_for=_has_dse,
                                      resolve=dse_disabled.resolve_spec))


def _knowledge_point(exp: Experiment, spec: dict):
    """The knowledge experiment's point (stem.knowledge): its world (the knowledge section's, the source's N,
    exposures and name kind), its base variant and seed, the validity threshold."""
    source, variant, k = K.split(spec["job"]["variant"])
    reader = exp.sources[source].reader
    spec.update({"knowledge": C.corpus_spec(exp, source)["knowledge"], "source": source, "n": int(reader["n"]), "exposures": int(reader["exposures"]),
                 "name_kind": reader.get("name_kind") or str(exp.knowledge.name_kind),
                 "base_variant": variant, "seed_index": k, "min_recall": exp.knowledge.min_recall})


# the knowledge experiment's capacity measure and its editing with a positive control: only its own points get
# them (stem.knowledge.targets)
ANALYSES.add("knowledge", Analysis("stem.analysis.knowledge:run", only_for=lambda kind: False,
                                   resolve=_knowledge_point))
ANALYSES.add("knowledge_edit", Analysis("stem.analysis.knowledge:run_edit", only_for=lambda kind: False,
                                        resolve=_knowledge_point))
