"""The analyze stage (stem/analysis): edit schemes and their undo, the Heaps fit, cosine spread, verdicts."""
import json
import math

import numpy as np
import pytest
import torch

from stem.config import experiment
from stem.analysis import editing as E
from stem.analysis import heaps as H
from stem.analysis import spread as S
from stem.layout import REPO
from stem.report import verdict as V
from stem.analysis.common import state_digest, table_sites
from stem.models.spec import ModelConfig
from stem.models.model import build_model
from conftest import checked_yaml


def small_model(ffn=("dense", "stem", "dense", "stem")):
    cfg = ModelConfig(vocab_size=64, d_model=16, n_layers=len(ffn), n_heads=2, n_kv_heads=1, d_ff=24,
                      max_seq_len=32, ffn=list(ffn))
    torch.manual_seed(0)
    return build_model(cfg).eval()


# ---- edit plans: hand-worked examples (Sec. 3.3, Fig. 4) ------------------------------------------------
def test_plans_hand_worked():
    assert E.plan("swap", 2, [5, 6]) == [(5,), (6,)]
    assert E.plan("pad_left", 4, [7, 8], pad_id=1) == [(1,), (1,), (7,), (8,)]
    assert E.plan("pad_right", 4, [7, 8], pad_id=1) == [(7,), (8,), (1,), (1,)]
    # floor(5/2) = 2 copies each, then the last target covers the fifth position
    assert E.plan("copy", 5, [7, 8]) == [(7,), (7,), (8,), (8,), (8,)]
    assert E.plan("copy", 7, [1, 2, 3]) == [(1,), (1,), (2,), (2,), (3,), (3,), (3,)]
    assert E.plan("average", 3, [7, 8]) == [(7, 8)] * 3
    assert E.plan("average", 1, [7, 8, 9]) == [(7, 8, 9)]
    # subset, n_s = 2 of [" of"(10), "Gre"(20), "at"(30)]: letters 2, 3, 2 -> "Gre" first, then the tie of
    # two letters goes to the higher id 30; target order kept
    assert E.plan("subset", 2, [10, 20, 30], pieces=[" of", "Gre", "at"]) == [(20,), (30,)]
    assert E.plan("subset", 1, [10, 20, 30], pieces=[" of", "Gre", "at"]) == [(20,)]


def test_plan_rejects_scheme_of_other_case():
    assert E.schemes_for(2, 2) == ("swap", "average")
    assert E.schemes_for(3, 2) == ("pad_left", "pad_right", "copy", "average")
    assert E.schemes_for(1, 2) == ("subset", "average")
    with pytest.raises(ValueError, match="does not apply to n_s=3, n_t=2"):
        E.plan("swap", 3, [1, 2])
    with pytest.raises(ValueError, match="needs a pad token"):
        E.plan("pad_left", 3, [1, 2])


def test_edit_rows_from_original_rows():
    w = torch.arange(12, dtype=torch.float32).view(6, 2)
    # a true swap of rows 1 and 2: each new row is read before any is written
    rows = E.edit_rows(w, [1, 2], [(2,), (1,)])
    assert torch.equal(rows[1], w[2]) and torch.equal(rows[2], w[1])
    # a source id twice in the span: the mean of its positions' vectors ((w4 + w5)/2 and w3)
    rows = E.edit_rows(w, [3, 3], [(4, 5), (3,)])
    assert torch.equal(rows[3], ((w[4] + w[5]) / 2 + w[3]) / 2)


def test_edit_then_undo_restores_bit_for_bit():
    model = small_model()
    sites = [w for _, w in table_sites(model)]
    assert [n for n, _ in table_sites(model)] == ["layers.1.ffn.table.weight", "layers.3.ffn.table.weight"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    digest = state_digest(model)
    ids = torch.tensor([[3, 9, 10, 4]])
    out0 = model(ids)
    with E.edited(sites + [model.tok_emb.weight], [9, 10], [(20,), (21, 22)]):
        for w in sites:
            assert torch.equal(w[9], before_row(before, w, model, 20))
        assert not torch.equal(model(ids), out0)
    assert state_digest(model) == digest
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert torch.equal(model(ids), out0)
    # also when the block raises
    with pytest.raises(RuntimeError):
        with E.edited(sites, [9], [(20,)]):
            raise RuntimeError("inside the edit")
    assert state_digest(model) == digest


def before_row(state, w, model, i):
    name = next(n for n, p in model.named_parameters() if p is w)
    return state[name][i]


def test_kl_and_topk_overlap():
    p = torch.log(torch.tensor([0.5, 0.25, 0.125, 0.125]))
    q = torch.log(torch.tensor([0.25, 0.25, 0.25, 0.25]))
    # KL(p||q) = 0.5 ln 2 + 0.25 ln 1 + 2 * 0.125 ln 0.5 = 0.25 ln 2
    assert E.kl(p, q) == pytest.approx(0.25 * math.log(2))
    assert E.topk_overlap(p, p, 2) == 1.0
    assert E.topk_overlap(p, torch.log(torch.tensor([0.1, 0.1, 0.4, 0.4])), 2) == 0.0


# ---- Heaps (Sec. 3.2.5) -------------------------------------------------------------------------------------
def test_heaps_fit_recovers_exact_power_law():
    # a stream whose prefix of length n holds exactly floor(2 sqrt(n)) distinct ids: at n = 16, 64, 256, 1024
    # that is 8, 16, 32, 64 = 2 n^0.5 exactly
    tokens, seen = [], 0
    for n in range(1, 1025):
        target = math.floor(2 * math.sqrt(n))
        if target > seen:
            seen += 1
            tokens.append(seen)
        else:
            tokens.append(1)
    tokens = np.array(tokens)
    lengths = [16, 64, 256, 1024]
    assert H.unique_counts(tokens, lengths) == [8, 16, 32, 64]
    L, u = H.heaps_curve(tokens, lengths + [5000], windows=1)  # 5000 does not fit: left out
    assert L == lengths
    fit = H.fit_power_law(L, u)
    assert fit["K"] == pytest.approx(2.0, rel=1e-9) and fit["beta"] == pytest.approx(0.5, abs=1e-9)
    assert fit["r2"] == pytest.approx(1.0)
    with pytest.raises(ValueError, match="fewer than two"):
        H.heaps_curve(tokens, [2000, 3000], windows=1)


# ---- angular spread (Fig. 6) ---------------------------------------------------------------------------------
def test_pairwise_cos_against_numpy():
    rng = np.random.default_rng(0)
    v = rng.normal(size=(7, 5))
    u = v / np.linalg.norm(v, axis=1, keepdims=True)
    ref = [u[i] @ u[j] for i in range(7) for j in range(i + 1, 7)]
    got = S.pairwise_cos(torch.tensor(v)).numpy()
    assert np.allclose(np.sort(got), np.sort(ref))
    d = S.describe(torch.tensor(ref))
    assert d["pairs"] == 21 and d["mean_abs"] == pytest.approx(np.mean(np.abs(ref)))
    assert sum(d["hist"]) == 21
    orth = S.describe(S.pairwise_cos(torch.eye(4)))
    assert orth["mean_abs"] == 0.0 and orth["pairs"] == 6


def test_first_occurrences():
    assert S.first_occurrences([5, 0, 5, 7, 0, 8, 9], 3, {0}) == ([5, 7, 8], [0, 3, 5])


# ---- verdicts (issue item 5) ------------------------------------------------------------------------------
def test_bootstrap_verdicts_on_constructed_inputs():
    a = [0, 1] * 50
    better = V.paired_bootstrap(a, [1] * 100)       # every item up by 0 or 1: mean +0.5, interval above 0
    assert better["delta"] == 0.5 and better["lo"] > 0
    assert V.classify(better, paper_sign=+2.1) == "agree"
    assert V.classify(better, paper_sign=-0.4) == "disagree"
    same = V.paired_bootstrap(a, a[1:] + a[:1])     # half the items up, half down: interval around 0
    assert same["delta"] == 0 and same["lo"] < 0 < same["hi"]
    assert V.classify(same, paper_sign=+3.0) == "inconclusive"
    assert V.classify(better, paper_sign=0.0) == "inconclusive"
    # the average of per-group means: groups (+1 everywhere) and (0 everywhere) -> +0.5 with zero width
    g = V.grouped_bootstrap([([0] * 5, [1] * 5), ([1] * 20, [1] * 20)])
    assert (g["delta"], g["lo"], g["hi"], g["n"]) == (0.5, 0.5, 0.5, 25)
    with pytest.raises(ValueError, match="equal-length"):
        V.paired_bootstrap([1, 2], [1])


def test_loss_directions_lower_is_better():
    base = {"window_loss": [3.0, 3.2, 3.1, 3.3] * 5}
    stem = {"window_loss": [2.9, 3.0, 3.0, 3.1] * 5}
    tiny = experiment.load(REPO / "config" / "tiny.yaml")
    rows = V.loss_directions(tiny, {("350m", "dense", "pretrain"): base, ("350m", "stem", "pretrain"): stem})
    assert len(rows) == 1 and rows[0]["verdict"] == "agree" and rows[0]["ours_delta"] == pytest.approx(-0.15)
    # dse: the DSE paper's claim (Table 1: DSE-27B 1.622 < Dense-4B 1.768), here a higher loss: disagree
    worse = {"window_loss": [x + 0.2 for x in base["window_loss"]]}
    rows = V.loss_directions(tiny, {("1b", "dense", "extend"): base, ("1b", "dse", "extend"): worse})
    assert len(rows) == 1 and rows[0]["paper_delta"] == pytest.approx(1.622 - 1.768)
    assert rows[0]["verdict"] == "disagree" and "DSE paper Table 1" in rows[0]["source"]


def test_tiny_analysis_targets_for_dse():
    """dse checkpoints get editing, spread, capacity, heldout (its loss direction) and the DSE paper's mechanism
    analyses, not heaps (no token-indexed STEM rows: a DSE table reads a constant number of hashed rows per token)."""
    from stem import config as C
    from stem.analysis import workflow as AW
    cfg = C.experiment.load(C.REPO / "config" / "tiny.yaml")
    names = {t.rsplit("/", 1)[1][:-5] for t in AW.targets(cfg) if "/350m/dse/" in t}
    assert names == {"editing", "spread", "capacity", "heldout", "logitlens", "cka", "dse_disabled"}
    assert AW.model_kind(cfg, "350m", "dse") == {"tables": False, "lookups": True, "dse": True, "variant": "dse",
                                                   "baseline": False}
    assert AW.model_kind(cfg, "350m", "hashmoe")["lookups"] is False


# ---- one analysis end to end on a real (untrained) checkpoint -------------------------------------------------
@pytest.fixture
def one_thread():
    """One intra-op thread (as the workflow runs analyses): two spin-waiting threads on a busy 2-core
    machine made this test 20x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_analyze_end_to_end(tiny_data, tmp_path, one_thread):
    from stem.analysis.run import analyze
    from stem.checkpoint import save_checkpoint
    cfg = ModelConfig(vocab_size=512, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=64,
                      ffn=("dense", "stem"))
    model = build_model(cfg).eval()
    spec = {"experiment": "tiny", "scale": "350m", "variant": "stem", "stage": "pretrain",
            "model": json.loads(json.dumps(cfg.to_dict()))}
    ckpt = tmp_path / "checkpoint"
    save_checkpoint(ckpt, model, spec, tiny_data["tokenizer"], {})
    job = {"experiment": "tiny", "scale": "350m", "variant": "stem", "stage": "pretrain"}
    world = {"seed": 7, "n_countries": 20, "n_people": 60, "n_filler": 500}
    ed = {"analysis": "editing", "job": job, "world": world, "relations": {"country": ["capital"], "person": ["profession"]},
          "pairs_per_case": 1, "collateral": 1, "known_entities": 2, "topk": 4, "seed": 0}
    r = analyze(ckpt, ed, tmp_path / "editing.json")
    assert r["restored_bit_identical"] and r["sites"] == ["embedding", "stem"]
    assert {e["case"] for e in r["edits"]} <= set(E.CASES) and r["edits"]
    assert json.loads((tmp_path / "editing.json").read_text())["label"].startswith("tiny")
    # the shipped prompt set of the paper config: its explicit pairs (Fig. 7, Sec. 3.3, country -> state)
    from stem import config as C
    paper = {**ed, "facts": str(C.REPO / "reference/analysis/edit_facts.yaml"), "relations": {"place": ["capital"]},
             "pairs_per_case": 0}
    paper.pop("world")
    p = analyze(ckpt, paper, tmp_path / "paper_editing.json")
    assert {(e["source"], e["target"]) for e in p["edits"]} >= {("Spain", "Germany"), ("United States", "California")}
    assert {e["scheme"] for e in p["edits"]} >= {"pad_left", "copy", "subset", "average"}
    h = analyze(ckpt, {"analysis": "heaps", "job": job, "source": "web", "manifest": tiny_data["manifests"]["web"],
                       "lengths": [4, 16, 64], "windows": 2}, tmp_path / "heaps.json")
    assert h["n_stem_layers"] == 1 and h["activated_stem_params"][0] == cfg.d_ff * h["unique"][0]
    from stem import provenance   # issue 32: an analysis JSON carries the provenance block, tied to its checkpoint
    prov = json.loads((tmp_path / "heaps.json").read_text())["provenance"]
    assert prov["train_spec_sha256"] == provenance.spec_hash(json.loads((ckpt / "config.json").read_text()))
    assert prov["tokenizer_sha256"] == provenance.file_hash(ckpt / "tokenizer.json") and prov["versions"]["torch"]
    assert prov["spec_sha256"] == provenance.spec_hash(h["spec"])
    with pytest.raises(ValueError, match="not the one this analysis job is for"):
        analyze(ckpt, {**ed, "job": {**job, "variant": "dense"}}, tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()


def test_analysis_directions_constructed():
    from stem.report.analyses import analysis_directions
    layer = lambda i, **sets: {"layer": i, "ffn": "x", **{k: {"mean_abs": v, "pairs": 10} for k, v in sets.items()}}  # noqa: E731
    spread = {("350m", "dense", "pretrain"): {"layers": [layer(0, up_proj=0.5), layer(1, up_proj=0.4)]},
              ("350m", "stem", "pretrain"): {"layers": [layer(0), layer(1, table=0.1)]}}
    items = lambda hits: [{"relation": "capital", "entity": f"e{i}", "hit": h} for i, h in enumerate(hits)]  # noqa: E731
    cap = {("350m", "dense", "pretrain"): {"items": items([0] * 30)},
           ("350m", "stem", "pretrain"): {"items": items([1] * 30)}}
    heaps = {("350m", "stem", "pretrain"): {"n_stem_layers": 2, "fit": {"beta": 0.7}, "lengths": [1, 2, 3],
                                            "activated_stem_params": [10, 20, 30]}}
    rows = {r["table"]: r for r in analysis_directions({"spread": spread, "capacity": cap, "heaps": heaps}, "dense")}
    assert rows["spread"]["ours_delta"] == pytest.approx(0.3)   # dense 0.4 at the STEM layer 1, STEM 0.1
    assert rows["spread"]["verdict"].startswith("agree")
    assert rows["capacity"]["verdict"] == "agree" and rows["capacity"]["ours_delta"] == 1.0
    assert rows["heaps"]["verdict"] == "agree" and rows["heaps"]["ours_delta"] == pytest.approx(0.3)


def test_config_checks_analysis_source_and_facts(tmp_path):
    import copy

    from stem import config as C
    from stem.analysis.editing import read_facts
    cfg = copy.deepcopy(checked_yaml(C.REPO / "config" / "tiny.yaml"))
    cfg["analysis"]["heaps"]["source"] = "wikipedia"
    with pytest.raises(C.ConfigError, match="key 'analysis.heaps.source': unknown source 'wikipedia'"):
        C.experiment.parse(cfg)
    bad = tmp_path / "facts.yaml"
    bad.write_text("kinds:\n  place:\n    templates: {capital: 'The capital of {e} is'}\n"
                   "    entities: {Spain: {capital: ' Madrid'}}\npairs:\n  - {kind: place, source: Spain, target: Oz}\n")
    with pytest.raises(ValueError, match=r"key 'pairs\[0\].target': 'Oz' is not an entity of kind 'place'"):
        read_facts(bad)
    _, pairs = read_facts(C.REPO / "reference/analysis/edit_facts.yaml")
    assert {"source": "United States", "target": "California", "kind": "place"} in pairs
    real = checked_yaml(C.REPO / "config" / "real.yaml")   # the keys of the real prompt set and of hf_parity
    for name, key, value in [("editing", "every_source", "yes"), ("editing", "first_token", 1),
                             ("editing", "stages", {"350m": ["posttrain"]}), ("hf_parity", "tolerance", 0),
                             ("hf_parity", "facts", None)]:
        bad = copy.deepcopy(real)
        bad["analysis"][name][key] = value
        with pytest.raises(C.ConfigError, match=f"key 'analysis.{name}.{key}") as e:
            C.experiment.parse(bad)
        assert len(str(e.value).splitlines()) == 1


def test_embedding_swap_on_dense_model_equals_control_prompt(tiny_data, one_thread):
    """An independent check of the measurement: in a dense model, swapping the input embedding rows of an
    equal-length source and target is the same computation as the target (control) prompt, so the edited
    next-token distribution must equal the control's (KL 0, full top-k overlap)."""
    from stem.data.synth import make_world
    from stem.data.tokenizer import load_tokenizer
    tok = load_tokenizer(tiny_data["tokenizer"])
    cfg = ModelConfig(vocab_size=512, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=64)
    torch.manual_seed(1)
    model = build_model(cfg).eval()
    facts = E.world_facts(make_world(7, 20, 60, 500), {})
    facts = {"country": {**facts["country"], "templates": {"capital": facts["country"]["templates"]["capital"]}}}
    pairs = [p for p in E.choose_pairs(tok, facts, 3, 0) if p["case"] == "equal"]
    assert pairs
    r = E.measure(model, tok, facts, pairs, {"topk": 4, "collateral": 2, "known_entities": 3, "seed": 0})
    swaps = [e for e in r["edits"] if e["scheme"] == "swap"]
    assert swaps and r["sites"] == ["embedding"] and r["restored_bit_identical"]
    for e in swaps:
        assert e["kl_control"] == pytest.approx(0.0, abs=1e-9) and e["topk_overlap"] == 1.0


def test_real_prompt_set_mode_every_source_first_token_moves(tiny_data, one_thread):
    """The mode config/real.yaml runs (every_source, first_token) on a tiny random dense model: every country a
    source once, its target the next one with another capital; a candidate's score is the next-token log-prob of its
    first token; the embedding swap of equal-length names is the control prompt's computation, so the edited top-k,
    ``moves`` and ``p_target`` are the control's; the prompts' logits are restored bit for bit (and would show an
    edit left in place)."""
    from stem.data.synth import make_world
    from stem.data.tokenizer import load_tokenizer
    tok = load_tokenizer(tiny_data["tokenizer"])
    cfg = ModelConfig(vocab_size=512, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=64)
    torch.manual_seed(2)
    model = build_model(cfg).eval()
    country = E.world_facts(make_world(7, 20, 60, 500), {})["country"]
    firsts, ents = set(), {}
    for name, a in country["entities"].items():   # capitals with distinct first tokens (what first_token needs)
        if E.encode(tok, a["capital"])[0] not in firsts:
            firsts.add(E.encode(tok, a["capital"])[0])
            ents[name] = a
    facts = {"country": {"templates": {"capital": country["templates"]["capital"]}, "entities": ents}}
    assert len(ents) < len(country["entities"])   # some capitals share a first token here: first_token refuses them
    with pytest.raises(ValueError, match="editing first_token: answers of country/capital share a first token"):
        E._Probe(model, tok, {"country": {**facts["country"], "entities": country["entities"]}},
                 first_token=True).candidates("country", "capital")
    pairs = E.every_source(tok, facts, set())
    names = list(ents)
    assert len(ents) >= 4 and [p["source"] for p in pairs] == names
    assert [p["target"] for p in pairs] == names[1:] + names[:1]   # capitals all differ: the next one
    assert E.every_source(tok, facts, {("country", names[0])})[0]["source"] == names[1]
    r = E.measure(model, tok, facts, pairs, {"topk": 3, "collateral": 1, "known_entities": len(ents), "seed": 0,
                                             "first_token": True})
    assert r["restored_bit_identical"] and r["restored_logits_bit_identical"]
    assert r["restored_logits_prompts"] == len(ents)
    probe = E._Probe(model, tok, facts, first_token=True)
    full = E._Probe(model, tok, facts).predict("country", "capital", names[:2])
    for n, (pred, sc, nxt) in probe.predict("country", "capital", names[:2]).items():
        first = [c[0] for c in probe.candidates("country", "capital")[1]]
        assert torch.equal(sc, nxt[first]) and torch.allclose(nxt, full[n][2], atol=1e-5)   # (batch round-off)
    swaps = [e for e in r["edits"] if e["scheme"] == "swap"]
    assert swaps and len(r["edits"]) >= len(pairs)
    for e in swaps:
        ctrl = E.score_many(model, [(E.encode(tok, f"The capital of {e['target']} is"), [[0]])])[0][1]
        t_first = E.encode(tok, e["target_answer"])[0]
        assert e["moves"] == (int(ctrl.argmax()) == t_first)
        assert e["p_target"] == pytest.approx(float(ctrl[t_first].exp()), abs=1e-6)
        assert [t for t, _ in e["top_after"]] == [t for t, _ in E.top_tokens(tok, ctrl, 3)]
    from stem.eval.generate import greedy_generate   # completes: greedy decoding read off one teacher-forced pass
    items = [(f"The capital of {n} is", a) for n in names for a in (ents[n]["capital"], " the capital")]
    for (prompt, answer), (ok, wrote) in zip(items, E.completes(model, tok, items)):
        want = E.encode(tok, answer)
        g = greedy_generate(model, E.encode(tok, prompt), len(want))
        cut = next((j + 1 for j, (x, y) in enumerate(zip(g, want)) if x != y), len(g))
        assert ok == (g == want) and wrote == tok.decode(g[:cut])
    logits = E._prompt_logits(model, tok, facts, pairs[:1])
    src, tgt = E.encode(tok, " " + names[0]), E.encode(tok, " " + names[1])
    with E.edited([model.tok_emb.weight], src, E.plan("average", len(src), tgt)):
        assert not torch.equal(E._prompt_logits(model, tok, facts, pairs[:1])[0], logits[0])


def test_real_editing_and_hf_parity_tables(tmp_path):
    """config/real.yaml's report tables real_editing and real_hf_parity: cells copied from the analysis JSONs."""
    from stem import config as C
    from stem import layout as L
    from stem.report import registry
    from stem.report.results import Results
    cfg = C.experiment.load(C.REPO / "config" / "real.yaml")
    ident = {"experiment": "real", "scale": "350m", "variant": "stem_insert", "stage": "midtrain"}
    summary = {"site": "stem", "scheme": "swap", "case": "all", "n": 26, "moves": 0.5, "moves_before": 0.0,
               "p_target_before": 0.01, "p_target": 0.3, "p_source_before": 0.4, "p_source": 0.02}
    results = {"editing": {**ident, "analysis": "editing", "known": {"place/capital": {"completed": 0.9}},
                           "summary": [summary, {**summary, "case": "equal"}], "restored_bit_identical": True,
                           "restored_logits_bit_identical": True},
               "hf_parity": {**ident, "analysis": "hf_parity", "documents": 26, "stem": {"acc": 0.5, "perplexity": 9.0},
                             "hf": {"acc": 0.5, "perplexity": 9.1}, "max_abs_loglik_diff": 2e-5, "tolerance": 1e-3}}
    for name, r in results.items():
        p = tmp_path / L.analysis_json("real", "350m", "stem_insert", "midtrain", name)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(r))
    res = Results("real", tmp_path / "results")
    ed = registry.table("real_editing").build(cfg, res).set_index("column")["value"]
    assert (ed["edits"], ed["moved"], ed["p_target"], ed["unedited_completed"], ed["restored_bitwise"]) == \
        (26, 0.5, 0.3, 0.9, True)
    hp = registry.table("real_hf_parity").build(cfg, res).set_index("column")["value"]
    assert (hp["hf_perplexity"], hp["max_abs_loglik_diff"], hp["tolerance"]) == (9.1, 2e-5, 1e-3)


def test_analysis_tables_and_figures_through_the_registry(tmp_path):
    """The registered report-only tables and figures from hand-made analysis JSONs: cells copied from the JSONs
    (long format), the directions with confidence, a wrong JSON named; no analysis configured: empty tables
    and figures that say so."""
    import matplotlib.pyplot as plt

    from stem import config as C
    from stem.report import registry
    from stem.report.figures import draw
    from stem.report.results import Results
    m = {**C.read_yaml(C.REPO / "config" / "tiny.yaml"), "matrix": {"350m": {"variants": ["dense", "stem"],
                                                                              "stages": ["pretrain"]}}}
    cfg = C.experiment.parse(m)
    hist = [0] * 40 + [10] + [0] * 39
    stats = {"mean_abs": 0.1, "mean": 0.0, "pairs": 10, "quantiles": {"q50": 0.0}, "hist": hist}
    edit = {"site": "stem", "kl_control": 0.1, "kl_control_before": 0.3}
    summary = [{"site": "stem", "scheme": "swap", "case": "all", "n": 1, "success": 0.0},
               {"site": "stem", "scheme": "swap", "case": "equal", "n": 1, "success": 0.0}]
    per = {"dense": {"spread": {"layers": [{"layer": 0, "ffn": "dense", "up_proj": {**stats, "mean_abs": 0.5}}]},
                     "heldout": {"window_loss": [3.0, 3.1, 3.2]}},
           "stem": {"spread": {"layers": [{"layer": 0, "ffn": "stem", "table": stats, "down_input": stats}]},
                    "heldout": {"window_loss": [2.9, 3.0, 3.0]},
                    "heaps": {"n_stem_layers": 1, "fit": {"K": 2.0, "beta": 0.5, "r2": 1.0}, "lengths": [4, 16],
                              "unique": [4.0, 8.0], "activated_stem_params": [96.0, 192.0], "source": "web"},
                    "editing": {"summary": summary, "edits": [edit] * 3}}}
    for v, analyses in per.items():
        for name, body in analyses.items():
            body = {**body, "analysis": name, "scale": "350m", "variant": v, "stage": "pretrain", "bins": 80,
                    "range": [-1.0, 1.0]}
            p = tmp_path / f"results/tiny/350m/{v}/pretrain/analysis/{name}.json"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(json.dumps(body))
    res = Results("tiny", tmp_path / "results")
    t = {n: registry.table(n) for n in ("editing", "spread", "heaps", "capacity", "directions", "edit_example")}
    assert not any(x.csv or x.compared for x in t.values())
    cell = lambda df, row, col: df[(df["row"] == row) & (df["column"] == col)]["value"].item()  # noqa: E731
    heaps = t["heaps"].build(cfg, res)
    assert cell(heaps, "stem pretrain", "activated_stem_params") == 192.0 and cell(heaps, "stem pretrain", "K") == 2.0
    assert heaps["source"].iloc[0] == "results/tiny/350m/stem/pretrain/analysis/heaps.json"
    spread = t["spread"].build(cfg, res)
    assert cell(spread, "dense pretrain: L0 dense up_proj", "mean_abs_cos") == 0.5
    assert cell(spread, "stem pretrain: L0 stem table", "q50") == 0.0 and len(spread) == 3 * 4
    import re

    from stem.report.tables import to_markdown, wide
    md = to_markdown(wide(spread)).splitlines()   # "mean |cos|" escaped: every line has the header's cells
    assert "mean \\|cos\\|" in md[0] and len({len(re.findall(r"(?<!\\)\|", line)) for line in md}) == 1
    editing = t["editing"].build(cfg, res)
    assert set(editing["column"]) == {"n", "success"} and len(editing) == 2  # the case "all" only
    assert t["capacity"].build(cfg, res).empty and t["edit_example"].build(cfg, res).empty
    dirs = t["directions"].build(cfg, res)
    verdict = dirs[dirs["column"] == "verdict"].set_index("row")["value"]
    assert verdict["stem pretrain: heldout_loss val_loss"] == "agree"   # -0.13 on every window
    assert verdict["stem pretrain: editing KL(control||edited) reduction"] == "agree"   # +0.2 on every edit
    assert cell(dirs, "stem pretrain: spread dense mean|cos| - STEM mean|cos|", "ours_delta") == pytest.approx(0.4)
    inputs = t["heaps"].inputs(cfg)
    assert inputs == ["results/tiny/350m/stem/pretrain/analysis/heaps.json"]
    for name, fig_name in (("spread", "fig6_spread"), ("heaps", "heaps_law")):
        files = {"analysis": [str(tmp_path / p) for p in registry.figure(fig_name).inputs(cfg, [])["analysis"]]}
        assert files["analysis"]
        fig = draw(fig_name, cfg, res, {}, files)
        assert any(line.get_xydata().size for ax in fig.axes for line in ax.get_lines())
        plt.close(fig)
    bad = tmp_path / "results/tiny/350m/stem/pretrain/analysis/heaps.json"
    bad.write_text(json.dumps({**json.loads(bad.read_text()), "variant": "dense"}))
    with pytest.raises(ValueError, match="heaps.json: records heaps/350m/dense/pretrain, expected heaps/350m/stem"):
        t["heaps"].build(cfg, res)
    cfg = C.experiment.parse({k: v for k, v in m.items() if k != "analysis"})   # no analysis: section
    assert all(x.build(cfg, res).empty for n, x in t.items() if n != "directions")
    assert all(x.inputs(cfg) == [] for x in t.values())
    fig = draw("fig6_spread", cfg, res, {}, registry.figure("fig6_spread").inputs(cfg, []))
    assert "config has no analysis.spread" in " ".join(x.get_text() for x in fig.axes[0].texts)
    plt.close(fig)


def test_tables_found_by_role_at_paper_shapes():
    """The edit sites of the real models (meta device: shapes only): one table per STEM layer, found by the
    declared lookup role, for every variant with tables; none for dense and Hash-MoE."""
    from stem import config as C
    from stem.analysis import workflow as AW
    from stem.analysis.common import stem_layers
    cfg = C.experiment.load(C.REPO / "config" / "paper.yaml")
    model = build_model(ModelConfig.from_dict(C.train_spec(cfg, "1b", "stem", "pretrain")["model"]), "meta")
    assert stem_layers(model) == [2, 5, 8, 11, 14]            # every third from 2: 5 of 16 (docs/variants.md)
    assert all(w.shape == (128256, 8192) for _, w in table_sites(model))
    assert [AW.has_tables(cfg, "350m", v) for v in ("dense", "hashmoe", "stem_gate", "stem_full")] == \
        [False, False, True, True]
