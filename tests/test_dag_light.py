"""The workflow's DAG builds without torch (issue 20 item 6): the FFN kinds' registered facts
(stem.models.registry.FFNFacts) and the closed-form parameter count (stem.models.spec.param_count) stand in
for the meta-device models, and must agree with them exactly. That the paper DAG built by Snakemake imports
no torch, lm_eval or matplotlib: tests/test_slurm.py's test_paper_dag_imports_no_torch (on that file's dry run
of the paper DAG, built once for both)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from stem import config as C  # noqa: E402
from stem.analysis import workflow as AW  # noqa: E402
from stem.models import registry  # noqa: E402
from stem.models.accounting import accounting  # noqa: E402
from stem.models.spec import ModelConfig, param_count  # noqa: E402
from stem.models.model import build_model  # noqa: E402

BUILTIN = ("dense", "stem", "stem_gate", "stem_dagger", "hashmoe", "moe")


def _models(experiment: str):
    cfg = C.experiment.load(REPO / "config" / f"{experiment}.yaml")
    for scale in cfg.archs:
        for variant in cfg.variants():
            yield cfg, scale, variant, C.model_config_for(cfg, scale, variant)


@pytest.mark.parametrize("experiment", ["tiny", "paper"])
def test_declared_facts_and_closed_form_are_the_built_models(experiment):
    """Every variant of the config at every scale: param_count == accounting's total_params, each layer's FFN
    module has its kind's declared facts, and the DAG's model_kind equals the one read from the built model."""
    for cfg, scale, variant, mc in _models(experiment):
        model = build_model(mc, "meta")
        assert param_count(mc) == accounting(model)["total_params"], (scale, variant)
        for i, block in enumerate(model.layers):
            facts, built = registry.ffn_facts(block.kind), registry.module_facts(block.ffn)
            assert (facts.table, facts.lookup, facts.params(mc)) == (built["table"], built["lookup"], built["params"])
        key = AW._model_json(cfg, scale, variant)
        assert AW._kind(key) == AW._built_kind(key), (scale, variant)


def test_every_builtin_kind_declares_its_facts():
    cfg = ModelConfig(vocab_size=96, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=32,
                      n_experts=3, moe_experts=4, moe_shared=2, moe_top_k=2, moe_d_ff=8)
    for kind in BUILTIN:
        facts = registry.ffn_facts(kind)
        assert None not in (facts.table, facts.lookup, facts.params), kind
        mc = ModelConfig.from_dict({**cfg.to_dict(), "ffn": [kind, kind]})
        assert param_count(mc) == accounting(build_model(mc, "meta"))["total_params"], kind
        # tie_embeddings: the embedding and the head are one V x d parameter, counted once
        tied = ModelConfig.from_dict({**mc.to_dict(), "tie_embeddings": True})
        a, b = accounting(build_model(mc, "meta")), accounting(build_model(tied, "meta"))
        assert param_count(tied) == b["total_params"] == a["total_params"] - 96 * 16, kind
        assert b["p_tot"] == a["p_tot"] and b["active_params"] == a["active_params"] - 96 * 16, kind


def test_a_wrong_declaration_is_a_one_line_error():
    from stem.models.ffn import DenseFFN
    registry.declare_ffn("toy_wrong", DenseFFN, table=True, lookup=False, params=lambda c: 1)
    try:
        mc = ModelConfig(vocab_size=32, d_model=8, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=12, max_seq_len=16,
                         ffn=("toy_wrong",))
        with pytest.raises(ValueError) as e:
            build_model(mc, "meta")
        assert "\n" not in str(e.value)
        assert "ffn kind 'toy_wrong' (DenseFFN, layer 0): its registration declares table=True (the module: " \
               "False), params=1 (the module: 288)" in str(e.value)
    finally:
        registry.FFN_KINDS.remove("toy_wrong")
        registry.FFN_FACTS.remove("toy_wrong")


def test_a_kind_declaring_nothing_is_built_to_find_out():
    """A kind registered without facts (tests/toy_ffn.py: a per-token bias table, a lookup): the DAG's model
    kind and parameter count come from the model built on the meta device, as before the facts."""
    import toy_ffn
    toy_ffn.register()
    try:
        assert registry.ffn_facts(toy_ffn.KIND) == registry.FFNFacts()
        mc = ModelConfig(vocab_size=32, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=12, max_seq_len=16,
                         ffn=("dense", toy_ffn.KIND))
        assert param_count(mc) is None
        assert AW._kind(json.dumps(mc.to_dict(), sort_keys=True)) == {"tables": False, "lookups": True, "dse": False}
    finally:
        toy_ffn.unregister()
