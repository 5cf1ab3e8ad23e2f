"""The knowledge experiment (issue 40, docs/knowledge.md): its world, its tokenizer, its config checks, its points
on the train rule, its capacity measure and report, on config/knowledge.yaml's own settings."""
import copy
import math
import re
from collections import Counter

import pytest
import torch

from stem import config as C
from stem import knowledge as K
from stem import layout as L
from stem.analysis import knowledge as AK
from stem.analysis.workflow import job_spec
from stem.data.bios import bios_documents, make_bios
from stem.data.tokenizer import add_words, load_tokenizer, train_bpe
from stem.layout import REPO
from stem.models.spec import model_config
from stem.models.model import build_model
from stem.report import knowledge as RK

RAW = C.read_yaml(REPO / "config" / "knowledge.yaml")
WORLD = {k: RAW["knowledge"][k] for k in ("seed", "names", "attributes", "templates")}


def parse(cfg):
    return C.experiment.parse(cfg, "knowledge.yaml")


def test_every_individual_is_seen_exposures_times_with_its_own_facts():
    bios = make_bios(WORLD)
    docs = list(bios_documents(None, 3, knowledge=WORLD, n=20, exposures=5))
    assert len(docs) == 100
    seen = Counter(d.split(" ")[0].removesuffix("'s") for d in docs)
    assert set(seen.values()) == {5} and set(seen) == set(bios.names[:20])
    for d in docs:   # every attribute stated once, with the individual's value
        i = bios.names.index(d.split(" ")[0].removesuffix("'s"))
        assert all(d.count(" " + bios.value(i, a) + ".") == 1 for a in range(len(bios.attributes)))
    orders = {tuple(sorted(range(4), key=lambda a, d=d, i=i: d.index(bios.value(i, a))))
              for d in docs for i in [bios.names.index(d.split(" ")[0].removesuffix("'s"))]}
    assert len(orders) > 6   # a fresh attribute order per exposure
    assert docs == list(bios_documents(None, 3, knowledge=WORLD, n=20, exposures=5))   # deterministic
    # the worlds are nested: N's individuals are the pool's first N, whatever N
    assert make_bios(WORLD).facts[:20] == bios.facts[:20]
    # each fact carries log2 |set| bits; the values are uniform over their set
    assert bios.bits_per_individual() == sum(math.log2(s) for s in WORLD["attributes"].values())
    assert {len(v) for v in bios.values} == set(WORLD["attributes"].values())


def test_names_are_one_token_and_the_control_s_are_several(tmp_path):
    one, multi = make_bios(WORLD), make_bios({**WORLD, "name_kind": "multi"})
    docs = list(bios_documents(None, 0, knowledge=WORLD, n=50, exposures=2))
    docs += list(bios_documents(None, 0, knowledge=WORLD, n=50, exposures=2, name_kind="multi"))
    path = tmp_path / "tokenizer.json"
    train_bpe(iter(docs), 300, path)
    add_words(path, one.words)
    tok = load_tokenizer(path)
    assert tok.vocab_size == 300 + WORLD["names"]
    for i in range(50):
        name = one.names[i]
        assert len(tok.encode_batch([name])[0]) == 1 and len(tok.encode_batch([" " + name])[0]) == 1
        assert tok.encode_batch([f"{name}'s school"])[0][0] == tok.encode_batch([name])[0][0]
        assert len(tok.encode_batch([" " + multi.names[i]])[0]) >= 2
    assert len(set(multi.names)) == len(multi.names) and multi.facts == one.facts   # same facts, other names


def test_pair_names_are_two_whole_word_tokens_from_fixed_pools(tmp_path):
    """The capacity sweep's names (name_kind pair): first + last from two pools the tokenizer adds as whole words,
    so every name is exactly two tokens, each shared by many individuals; the same facts; one and multi unchanged."""
    one, pair = make_bios(WORLD), make_bios({**WORLD, "name_kind": "pair"})
    side = math.ceil(math.sqrt(WORLD["names"])) + 2
    assert len(pair.words) == 2 * side and not set(pair.words) & set(one.words) and pair.facts == one.facts
    assert len(set(pair.names)) == len(pair.names) == WORLD["names"]
    assert make_bios({**WORLD, "name_kind": "pair", "pair_pool": 30}).words != pair.words
    with pytest.raises(ValueError, match="pair_pool = 20"):
        make_bios({**WORLD, "name_kind": "pair", "pair_pool": 20})
    path = tmp_path / "tokenizer.json"
    train_bpe(iter(bios_documents(None, 0, knowledge=WORLD, n=30, exposures=2)), 300, path)
    add_words(path, one.words + pair.words)
    tok = load_tokenizer(path)
    firsts = Counter()
    for name in pair.names[:200]:
        ids = tok.encode_batch([" " + name])[0]
        assert len(ids) == 2 and tok.encode_batch([f"{name}'s school"])[0][:2] == tok.encode_batch([name])[0]
        firsts[ids[0]] += 1
    assert len(firsts) <= side and max(firsts.values()) >= 5   # no token identifies an individual


def test_the_tokenizer_adds_the_pair_pools_only_where_a_source_has_pair_names():
    exp = parse(copy.deepcopy(RAW))
    kn = exp.knowledge
    assert C.tokenizer_spec(exp, L.KNOWLEDGE)["add_pair_names"] is True
    assert K.capacity_sources(exp) == [s for s in kn.sources if s.startswith("p")] and kn.capacity_names == "pair"
    for s in K.capacity_sources(exp):   # one pass at pair_tokens_per_bio, equal exposures
        r = exp.sources[s].reader
        assert K.steps(exp, s) == math.ceil(r["n"] * r["exposures"] * kn.pair_tokens_per_bio / (16 * 64))
    a = job_spec(exp, "350m", "k__p0200__dense", "pretrain", "knowledge")
    assert (a["n"], a["name_kind"]) == (200, "pair")
    cfg = copy.deepcopy(RAW)
    cfg["knowledge"]["sources"] = [s for s in cfg["knowledge"]["sources"] if not s.startswith("p")]
    cfg["knowledge"].update(capacity_names="one", seeds_at=["n0050"])
    assert "add_pair_names" not in C.tokenizer_spec(parse(cfg), L.KNOWLEDGE)


@pytest.mark.parametrize("edit, key", [
    (lambda c: c["knowledge"].update(pair_pool=20), "knowledge.pair_pool"),
    (lambda c: c["knowledge"].update(pair_pool=1), "knowledge.pair_pool"),
    (lambda c: c["knowledge"].update(pair_tokens_per_bio=0), "knowledge.pair_tokens_per_bio"),
    (lambda c: c["knowledge"].update(capacity_names="multi"), "knowledge.capacity_names"),
    (lambda c: c["knowledge"].update(capacity_names="two"), "knowledge.capacity_names"),
    (lambda c: c["archs"]["350m"].update(vocab_size=829), "archs.350m.vocab_size"),
    (lambda c: c["knowledge"].update(name_tokens=900), "knowledge.name_tokens"),
    (lambda c: c["knowledge"].update(name_tokens=0), "knowledge.name_tokens"),
    (lambda c: c["sources"]["n0050"].update(n=120), "sources.n0050.n"),
    (lambda c: c["knowledge"].update(variants_at={"n9999": ["dense"]}), "knowledge.variants_at"),
    (lambda c: c["knowledge"].update(variants_at={"n0050": ["moe"]}), "knowledge.variants_at.n0050"),
    (lambda c: c["sources"]["p0200"].update(name_kind="triple"), "sources.p0200.name_kind"),
    (lambda c: c["sources"]["p0200"].update(n=900), "sources.p0200.n"),
    (lambda c: c["knowledge"]["templates"]["city"].append("{name} lives somewhere."), "knowledge.templates.city[3]"),
    (lambda c: c["knowledge"]["templates"]["major"].append("Born in {value}."), "knowledge.templates.major[3]"),
    (lambda c: c["sources"]["n0050"].update(exposures=10), "sources.n0050.exposures"),
    (lambda c: c["knowledge"]["variants"].append("nosuch"), "knowledge.variants"),
    (lambda c: c["knowledge"]["seeds_for"].append("moe"), "knowledge.seeds_for"),
    (lambda c: c["archs"]["350m"].update(vocab_size=700), "archs.350m.vocab_size"),
    (lambda c: c["knowledge"]["tokenizer"].pop("add_names"), "knowledge.tokenizer.add_names"),
    (lambda c: c["knowledge"].update(vocab_size=700), "knowledge.vocab_size"),
    (lambda c: c["knowledge"].update(train={"lr": 0}), "knowledge.train.lr"),
    (lambda c: c["knowledge"].update(sources=["n0050", "web"]), "knowledge.sources[1]"),
    (lambda c: c["analysis"]["knowledge_edit"]["inject"].update(people=51), "analysis.knowledge_edit.inject.people"),
    (lambda c: c["analysis"]["knowledge_edit"]["inject"].update(steps=0), "analysis.knowledge_edit.inject.steps"),
])
def test_bad_knowledge_config_is_one_line_naming_the_key(edit, key):
    cfg = copy.deepcopy(RAW)
    cfg["sources"]["web"] = {"kind": "synth", "generator": "web", "bytes": 1000}
    edit(cfg)
    with pytest.raises(C.ConfigError) as e:
        parse(cfg)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("knowledge.yaml: ") and f"'{key}'" in msg, msg


def test_points_are_train_jobs_of_one_source_one_pass_each():
    exp = parse(copy.deepcopy(RAW))
    kn, points = exp.knowledge, K.points(exp)
    seeded = [p for p in points if K.split(p)[2]]
    assert len(points) == sum(len(K.variants_at(exp, s)) for s in kn.sources) + len(seeded)
    assert K.variants_at(exp, "n0050") == ("dense", "stem", "stem_half") and K.variants_at(exp, "p0400") == kn.variants
    assert {K.split(p)[0] for p in seeded} == set(kn.seeds_at) and {K.split(p)[1] for p in seeded} == set(kn.seeds_for)
    spec = C.train_spec(exp, "350m", "k__p0050__stem__s2", "pretrain")
    st = exp.stages["pretrain"]["350m"]
    assert list(spec["data"]) == ["p0050"] and spec["seed"] == exp.seed + 2
    assert spec["model"]["ffn"] == ["dense", "dense", "stem"] and spec["out_dir"].endswith("k__p0050__stem__s2/pretrain")
    # equal exposures: every world is seen E times by one pass (no step floor confounding N with exposures)
    assert len({exp.sources[s].reader["exposures"] for s in kn.sources}) == 1
    for s in kn.sources:
        r = exp.sources[s].reader
        per_bio = kn.pair_tokens_per_bio if K.name_kind(exp, s) == "pair" else kn.tokens_per_bio
        assert C.train_spec(exp, "350m", K.point_id(s, "dense"), "pretrain")["train"]["steps"] == \
            math.ceil(r["n"] * r["exposures"] * per_bio / (st.batch_size * st.seq_len))
    assert C.train_spec(exp, "350m", "k__n0050__stem_half", "pretrain")["model"]["ffn"] == ["dense", "stem", "dense"]
    with pytest.raises(C.ConfigError, match="not a point"):
        C.train_spec(exp, "350m", "k__n0050__hashmoe", "pretrain")   # variants only where variants_at says
    with pytest.raises(C.ConfigError, match="not a point"):
        C.train_spec(exp, "350m", "k__p0200__hashmoe__s1", "pretrain")   # seeds for the variants of seeds_for
    a = job_spec(exp, "350m", "k__n0050__dense", "pretrain", "knowledge")
    assert (a["n"], a["name_kind"], a["base_variant"], a["knowledge"]["names"]) == (50, "one", "dense", 800)
    targets = K.targets(exp)
    edited = [p for p in points if K.split(p)[0] in RAW["analysis"]["knowledge_edit"]["sources"]]
    assert len(targets) == 2 * len(points) + len(edited) and all(re.search(r"results/knowledge/350m/k__\w+/pretrain/", t)
                                                   for t in targets)


def test_points_read_the_knowledge_section_s_tokenizer_and_leave_the_scale_s_jobs_as_they_were():
    """config/tiny.yaml's reduced knowledge world (docs/knowledge.md "Inside make smoke"): its points train on the
    knowledge section's own tokenizer and shards (stem.layout.KNOWLEDGE, not a scale) with the 350m stand-in's
    architecture at the section's vocabulary and stage settings; without the section every other job's spec is
    the same (no new scale, tiny's training jobs untouched)."""
    raw = C.read_yaml(REPO / "config" / "tiny.yaml")
    exp = C.experiment.parse(copy.deepcopy(raw), "tiny.yaml")
    kn = exp.knowledge
    point = K.point_id(kn.sources[0], "stem")
    spec = C.train_spec(exp, kn.scale, point, kn.stage)
    assert spec["tokenizer"] == L.tokenizer_path("tiny", L.KNOWLEDGE) == "data/tiny/knowledge/tokenizer/tokenizer.json"
    assert spec["data"] == {kn.sources[0]: {"weight": 1.0, "manifest": L.tokens_manifest("tiny", L.KNOWLEDGE, kn.sources[0])}}
    arch = C.experiment.dataclass_mapping(exp.archs[kn.scale])
    assert spec["model"]["vocab_size"] == kn.vocab_size and spec["model"]["d_model"] == arch["d_model"]
    assert (spec["train"]["lr"], spec["train"]["batch_size"], spec["train"]["seq_len"]) == (1e-2, 8, 64)
    assert C.tokenizer_spec(exp, L.KNOWLEDGE)["add_names"] and "knowledge" in C.tokenizer_spec(exp, L.KNOWLEDGE)
    assert C.tokenize_spec(exp, L.KNOWLEDGE, kn.sources[0])["vocab_size"] == kn.vocab_size
    assert set(C.SCALES) >= set(exp.archs) and L.KNOWLEDGE not in C.SCALES
    bare = {k: v for k, v in raw.items() if k != "knowledge"}
    bare["sources"] = {k: v for k, v in raw["sources"].items() if v.get("generator") != "bios"}
    bare["analysis"] = {k: v for k, v in raw["analysis"].items() if not k.startswith("knowledge")}
    without = C.experiment.parse(bare, "tiny.yaml")
    jobs = C.train_targets(exp) + C.seed_targets(exp)
    assert jobs == C.train_targets(without) + C.seed_targets(without)
    assert all(C.train_spec(exp, *j) == C.train_spec(without, *j) for j in jobs)
    assert all(C.corpus_spec(exp, s) == C.corpus_spec(without, s) for s in without.sources
               if without.sources[s].kind == "synth")
    assert all(C.tokenizer_spec(exp, s) == C.tokenizer_spec(without, s) for s in exp.tokenizer)


def _model(vocab):
    cfg = model_config({"vocab_size": vocab, "d_model": 32, "n_layers": 3, "n_heads": 4, "n_kv_heads": 2,
                        "d_ff": 64, "max_seq_len": 64}, {"ffn": "stem", "placement": [1]})
    torch.manual_seed(0)
    m = build_model(cfg)
    m.init_weights(0)
    return m.eval()


def _world_model(tmp_path):
    """The test world, a BPE over its biographies with every name one token, and a small STEM model of its size."""
    bios = make_bios(WORLD)
    path = tmp_path / "tokenizer.json"
    train_bpe(iter(bios_documents(None, 0, knowledge=WORLD, n=30, exposures=2)), 300, path)
    add_words(path, bios.words)
    tok = load_tokenizer(path)
    return bios, tok, _model(tok.vocab_size)


def test_bits_and_recall_are_the_value_tokens_cross_entropy_and_argmax(tmp_path):
    bios, tok, model = _world_model(tmp_path)
    items = AK.probes(bios, 6, tok)
    scored = AK.score(model, items, batch=5)
    for (i, a, p, v), (ce, hit) in zip(items, scored):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + v]))[0], -1)
        want = -sum(float(logp[len(p) - 1 + j, t]) for j, t in enumerate(v)) / math.log(2)
        assert ce == pytest.approx(want, abs=1e-4)
        assert hit == all(int(logp[len(p) - 1 + j].argmax()) == t for j, t in enumerate(v))
        assert tok.decode(v) == " " + bios.value(i, a)
    counts = AK.param_counts(model)
    assert counts["params_total"] == sum(p.numel() for p in model.parameters())
    assert counts["params_activated"] == counts["params_active"] + 64   # one row of the one STEM table


def test_the_capacity_ratio_interval_and_the_validity_rule():
    items = lambda bits: [{"bits": b} for b in bits]   # noqa: E731
    base = [{"items": items([1.0] * 50 + [0.5] * 50)}]
    ci = RK.ratio_ci(base, [{"items": items([2.0] * 50 + [1.0] * 50)}])
    assert ci["delta"] == pytest.approx(1.0) and ci["lo"] == pytest.approx(1.0) and ci["n"] == 100
    noisy = RK.ratio_ci(base, [{"items": items([1.0, 0.0] * 50)}])
    assert noisy["lo"] < noisy["delta"] < noisy["hi"]
    exp = parse(copy.deepcopy(RAW))   # validity: the capacity sweep's smallest world (p0050, pair names)
    smallest = {K.point_id("p0050", v): {"recall": 0.95, "n": 50} for v in exp.knowledge.variants}
    assert RK.validity(exp, smallest)[0]
    smallest[K.point_id("p0050", "stem")]["recall"] = 0.5
    ok, why = RK.validity(exp, smallest)
    assert not ok and "invalid" in why and "stem 0.50" in why and "p0050" in why
    assert not RK.validity(exp, {K.point_id("n0050", v): {"recall": 1.0} for v in exp.knowledge.variants})[0]


def test_the_capacity_ratio_rows_are_the_capacity_sweep_s():
    exp = parse(copy.deepcopy(RAW))
    item = lambda b: {"n": 50, "name_kind": "x", "recall": 0.95, "items": [{"bits": b}] * 20}   # noqa: E731
    got = {K.point_id(s, v): item(2.0 if v == "stem" else 1.0) for s in exp.knowledge.sources
           for v in exp.knowledge.variants}
    rows = RK.directions(exp, got)
    assert {r["column"].split(" at ")[1].split(" ")[0] for r in rows} == set(K.capacity_sources(exp))
    assert all(r["variant"] in ("stem", "stem_half") and "two-token (pair) names" in r["source"] for r in rows)
    assert [r["ours_delta"] for r in rows if r["variant"] == "stem"] == [pytest.approx(1.0)] * len(K.capacity_sources(exp))


def test_an_edit_of_every_token_indexed_row_is_the_positive_control_and_is_undone_bit_for_bit(tmp_path):
    """A's embedding and STEM rows <- B's: A's prompts then read exactly B's rows, so A answers B's values exactly
    as often as B does; B's own facts are untouched; the model is restored bit for bit."""
    from stem.analysis.common import state_digest, table_sites

    bios, tok, model = _world_model(tmp_path)
    with torch.no_grad():   # a model that answers something: the head biased towards some value tokens
        model.lm_head.weight[tok.encode_batch([" " + bios.values[0][3]])[0][0]] += 0.5
    before = {i: AK._hits(model, AK.probes_of(bios, tok, [i])) for i in range(8)}
    digest = state_digest(model)
    params = [model.tok_emb.weight, *(p for _, p in table_sites(model))]
    e = AK._edit(model, bios, tok, params, 1, 2, [3, 4, 5], before)
    as_b = [(1, a, p, v) for (_, a, p, _), (_, _, _, v) in zip(AK.probes_of(bios, tok, [1]), AK.probes_of(bios, tok, [2]))]
    b_prompts = AK.probes_of(bios, tok, [2])
    assert all(x[2][0] == tok.eos_id for x in as_b + b_prompts)   # a probe starts as a biography does: after EOS
    assert [x[2][2:] for x in as_b] == [x[2][2:] for x in b_prompts]   # the prompts differ in the name token only
    assert e["success"] == sum(before[2]) / len(before[2]) and e["b_unaffected"] == 1.0 and e["collateral"] == 0.0
    assert state_digest(model) == digest


def _merged(base: dict, over: dict) -> dict:
    """Snakemake's merge of a second --configfile over the first: mappings key by key, anything else replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merged(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out


def test_the_gpu_overlay_scales_n_and_the_model_and_keeps_the_experiment():
    exp = parse(_merged(copy.deepcopy(RAW), C.read_yaml(REPO / "config" / "knowledge-gpu.yaml")))
    kn = exp.knowledge
    assert max(K.world_size(exp, s) for s in kn.sources) == kn.names == 6400 and exp.archs["350m"].d_model == 32
    need = kn.tokenizer.vocab_size + kn.name_tokens + 2 * K.pair_pool(kn.names)   # rounded up to a multiple of 64
    assert need <= exp.archs["350m"].vocab_size < need + 64 and K.world_size(exp, "n0400") + 4 <= kn.name_tokens
    assert (kn.variants, kn.attributes, kn.templates) == (parse(copy.deepcopy(RAW)).knowledge.variants,
                                                          RAW["knowledge"]["attributes"], parse(copy.deepcopy(RAW)).knowledge.templates)
    assert K.point_id("p6400", "stem", 2) in K.points(exp) and K.capacity_sources(exp) == ["p0400", "p1600", "p6400"]


def test_injection_fits_only_the_new_token_s_rows_and_is_undone(tmp_path):
    """A held-out individual (never in the world of N): fitting its rows lowers the loss of its biography and moves
    nothing but those rows; its rows are restored after; too many held-out individuals is a one-line error."""
    import random

    from stem.analysis.common import state_digest, table_sites

    bios, tok, model = _world_model(tmp_path)
    params = [model.tok_emb.weight, *(p for _, p in table_sites(model))]
    x = AK.held_out(bios, 30, 1)[0]
    tx = tok.encode_batch([" " + bios.names[x]])[0][0]
    others = {k: v.clone() for k, v in model.state_dict().items()}
    batch = AK._bio_batch(bios, tok, x, 2, "t")
    loss = AK.fit_rows(model, params, [tx], [batch], 8, 0.05)[0]
    assert loss[1] < loss[0]
    for k, v in model.state_dict().items():
        changed = (v != others[k]).reshape(v.shape[0], -1).any(-1) if v.dim() else v != others[k]
        assert k in ("tok_emb.weight", *(n for n, _ in table_sites(model))) and changed.nonzero().flatten().tolist() \
            == [tx] if changed.any() else True, k
    model.load_state_dict(others)
    digest = state_digest(model)
    before = {i: AK._hits(model, AK.probes_of(bios, tok, [i])) for i in range(4)}
    sites = {"stem": params[1:], "embedding": params[:1], "all": params}
    out = AK.inject(model, bios, tok, sites, 4, {"people": 2, "steps": 2, "docs": 2, "lr": 0.05}, random.Random(0),
                    before)
    assert out["undo_bit_exact"] and state_digest(model) == digest and set(out["sites"]) == set(sites)
    assert all(p["x"] >= 4 and p["fit"]["collateral"] == 0.0 for p in out["sites"]["all"]["people"])
    with pytest.raises(ValueError, match="inject.people: 800; expected at most"):
        AK.held_out(bios, 4, len(bios.names))


def test_rows_fitted_together_are_each_fitted_as_alone(tmp_path):
    """fit_rows fits several held-out individuals' rows in one batch on the sum of their own mean losses: each row's
    result and losses are its own fit's (a row occurs only in its own biographies), to float rounding."""
    from stem.analysis.common import table_sites

    bios, tok, model = _world_model(tmp_path)
    params = [model.tok_emb.weight, *(p for _, p in table_sites(model))]
    people = AK.held_out(bios, 30, 2)
    rows = [tok.encode_batch([" " + bios.names[x]])[0][0] for x in people]
    batches = [AK._bio_batch(bios, tok, x, d, f"t{x}") for x, d in zip(people, (2, 3))]
    start = {id(p): p.detach().clone() for p in params}
    alone = []
    for r, b in zip(rows, batches):
        alone.append((AK.fit_rows(model, params, [r], [b], 6, 0.05)[0], [p[r].detach().clone() for p in params]))
        with torch.no_grad():
            for p in params:
                p.copy_(start[id(p)])
    together = AK.fit_rows(model, params, rows, batches, 6, 0.05)
    for r, (loss, fitted), got in zip(rows, alone, together):
        assert got == pytest.approx(loss, rel=1e-5)
        assert all(torch.allclose(p[r], f, atol=1e-6) for p, f in zip(params, fitted))


def test_a_direction_row_from_fewer_seeds_than_the_config_asks_is_a_point_estimate():
    """Its interval would hold the facts' variance only (docs/knowledge.md: at p0200 the one-seed intervals excluded
    the three-seed estimates), so it gets no interval, no p-value and a point-estimate verdict; a full row is kept."""
    exp = parse(copy.deepcopy(RAW))
    row = {"ours_delta": -0.4, "paper_delta": 1.0, "lo": -0.5, "hi": -0.3, "p": 1e-9, "verdict": "disagree"}
    one = RK.seeded(exp, {**row, "seeds": 1})
    assert (one["lo"], one["hi"], one["p"], one["verdict"]) == (None, None, None, "disagree (point estimate)")
    assert RK.seeded(exp, {**row, "seeds": len(exp.knowledge.seeds)}) == {**row, "seeds": len(exp.knowledge.seeds)}
    assert RK.seeded(exp, {**row, "ours_delta": 0.0, "seeds": 1})["verdict"] == "inconclusive (point estimate)"
