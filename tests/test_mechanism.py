"""The DSE paper's mechanism analyses (stem.analysis: logitlens, cka, dse_disabled) against independent references:
LogitLens KL vs numpy on truncated models, unbiased HSIC vs its U-statistic and its O(n^2) sum form, CKA's
invariances, the soft alignment on a hand example, and the three analyses end to end through the analyze stage."""
import copy
import itertools
import json

import numpy as np
import pytest
import torch

from stem.analysis import cka as CKA
from stem.analysis import logitlens as LL
from stem.models.spec import ModelConfig
from stem.models.model import build_model


@pytest.fixture(autouse=True)
def one_thread():
    """One intra-op thread, as the workflow runs analyses (spin-waiting threads on a busy 2-core machine are
    many times slower; tests/test_analysis.py does the same)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def dse_model(vocab=97, layers=4, dse=(0, 2), seed=0):
    cfg = ModelConfig.from_dict(dict(vocab_size=vocab, d_model=16, n_layers=layers, n_heads=2, n_kv_heads=1, d_ff=24,
                                     max_seq_len=64, dse={"layers": list(dse), "rows_per_head": 31, "d_mem": 8,
                                                          "heads": 2}))
    torch.manual_seed(seed)
    return build_model(cfg).eval()


# ---- LogitLens ------------------------------------------------------------------------------------------
def test_logitlens_kl_against_numpy_on_truncated_models():
    """KL(final || layer l) per window vs numpy in float64, where layer l's logits come from a copy of the model
    cut after block l (no hooks) and the final ones from the whole model; the last layer's KL is exactly 0."""
    model = dse_model()
    x = torch.randint(0, 97, (3, 11))
    got = LL.layer_kl(model, x, batch=2).numpy()

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    with torch.no_grad():
        logp = log_softmax(model(x).double().numpy())
        for layer in range(4):
            cut = copy.deepcopy(model)
            cut.layers = cut.layers[:layer + 1]
            logq = log_softmax(cut(x).double().numpy())
            want = (np.exp(logp) * (logp - logq)).sum(-1).mean(-1)
            np.testing.assert_allclose(got[:, layer], want, rtol=1e-4, atol=1e-6)
    assert (got[:, -1] == 0).all() and (got[:, :-1] > 0).all()


# ---- CKA ------------------------------------------------------------------------------------------------
def hsic_u_statistic(K, L):
    """Song et al. (2012) Theorem 2: HSIC_1 is the U-statistic over distinct index 4-tuples with kernel
    h = 1/4! sum over the tuple's orderings (t,u,v,w) of k_tu l_tu + k_tu l_vw - 2 k_tu l_tv (O(n^4))."""
    n, total = len(K), 0.0
    for quad in itertools.permutations(range(n), 4):
        t, u, v, w = quad
        total += K[t, u] * L[t, u] + K[t, u] * L[v, w] - 2 * K[t, u] * L[t, v]
    return total / (n * (n - 1) * (n - 2) * (n - 3))   # every ordering of every 4-set counted once


def hsic_sums(K, L):
    """The estimator's formula written as O(n^2) loops over the off-diagonal entries."""
    n = len(K)
    off = [(i, j) for i in range(n) for j in range(n) if i != j]
    tr = sum(K[i, j] * L[j, i] for i, j in off)
    sk, sl = sum(K[i, j] for i, j in off), sum(L[i, j] for i, j in off)
    rows = sum(sum(K[i, j] for j in range(n) if j != i) * sum(L[i, j] for j in range(n) if j != i) for i in range(n))
    return (tr + sk * sl / ((n - 1) * (n - 2)) - 2 * rows / (n - 2)) / (n * (n - 3))


def test_unbiased_hsic_against_u_statistic_and_sums():
    rng = np.random.default_rng(0)
    X, Y = rng.normal(size=(7, 3)), rng.normal(size=(7, 5))
    K, L = X @ X.T, Y @ Y.T
    got = float(CKA.hsic1(torch.from_numpy(K), torch.from_numpy(L)))
    assert got == pytest.approx(hsic_u_statistic(K, L), rel=1e-10)
    assert got == pytest.approx(hsic_sums(K, L), rel=1e-10)
    with pytest.raises(ValueError, match="at least 4 samples"):
        CKA.hsic1(torch.eye(3), torch.eye(3))


def test_minibatch_cka_identity_invariances_and_accumulation():
    rng = np.random.default_rng(1)
    X = torch.from_numpy(rng.normal(size=(40, 6)))
    Y = torch.from_numpy(rng.normal(size=(40, 4))) + 0.5 * X[:, :4]
    Q, _ = torch.linalg.qr(torch.from_numpy(rng.normal(size=(6, 6))))
    S = CKA.minibatch_cka([X, X @ Q, 3.7 * X, Y], [X, Y], batch=10)
    assert torch.allclose(S[:3, 0], torch.ones(3, dtype=torch.float64), atol=1e-12)   # CKA(X, X) = 1
    assert torch.allclose(S[:3, 1], S[0, 1].expand(3), atol=1e-12)    # rotation and isotropic scaling
    assert S[3, 1] == pytest.approx(1.0) and 0 < S[0, 1] < 1
    # accumulation: the mean over minibatches of each HSIC term (by hand, from the O(n^2) sums), then the ratio
    Xn, Yn = X.numpy(), Y.numpy()
    h = lambda A, B: np.mean([hsic_sums(A[b:b + 10] @ A[b:b + 10].T, B[b:b + 10] @ B[b:b + 10].T)  # noqa: E731
                              for b in range(0, 40, 10)])
    assert float(S[0, 1]) == pytest.approx(h(Xn, Yn) / np.sqrt(h(Xn, Xn) * h(Yn, Yn)), rel=1e-9)
    # a remainder below one minibatch is left out: 43 rows give the same S as the first 40
    X3 = torch.cat([X, X[:3]])
    assert torch.allclose(CKA.minibatch_cka([X3], [torch.cat([Y, Y[:3]])], 10), S[0:1, 1:2])


def test_soft_alignment_hand_example():
    S = [[0.9, 0.1, 0.0],
         [0.5, 0.2, 0.1],
         [0.1, 0.8, 0.3],
         [0.0, 0.6, 0.7]]
    # column 0: rows 0 (0.9), 1 (0.5) -> 0.5/1.4; column 1: rows 2 (0.8), 3 (0.6) -> 3.4/1.4; column 2: 2.7/1.0
    assert CKA.soft_alignment(S, 2) == pytest.approx([0.5 / 1.4, 3.4 / 1.4, 2.7])
    assert CKA.soft_alignment(S, 1) == pytest.approx([0.0, 2.0, 3.0])
    assert CKA.soft_alignment(S, 9) == pytest.approx([(0.5 + 0.2) / 1.5, (0.2 + 1.6 + 1.8) / 1.7, (0.1 + 0.6 + 2.1) / 1.1])


# ---- the three analyses through the analyze stage ---------------------------------------------------------
def test_mechanism_analyses_end_to_end(tiny_data, tmp_path):
    """logitlens, cka and dse_disabled on saved (untrained) DSE and dense checkpoints: the job specs the workflow
    builds, the baseline read from its checkpoint, entity positions found in held-out text, the eval path with the
    gate overridden (normal == the same model through lm-eval unmodified)."""
    from stem import config as C
    from stem.analysis import workflow as AW
    from stem.analysis.cka import entity_names, entity_positions
    from stem.analysis.common import val_windows
    from stem.analysis.run import analyze
    from stem.data.synth import make_world
    from stem.data.tokenizer import load_tokenizer
    from stem.eval import fixtures
    from stem.eval.spec import suite_spec
    from stem.checkpoint import save_checkpoint
    tok = load_tokenizer(tiny_data["tokenizer"])
    ckpts = {}
    for variant, model in (("dse", dse_model(512, 3, (0,))), ("dense", build_model(ModelConfig.from_dict(dict(
            vocab_size=512, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=24, max_seq_len=64))).eval())):
        if variant == "dse":
            model.set_dse_vocabulary(tok)
        spec = {"experiment": "tiny", "scale": "350m", "variant": variant, "stage": "pretrain",
                "model": json.loads(json.dumps(model.cfg.to_dict()))}
        ckpts[variant] = tmp_path / variant / "checkpoint"
        save_checkpoint(ckpts[variant], model, spec, tiny_data["tokenizer"], {})
    raw = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg = C.experiment.parse(raw, "tiny.yaml")
    job = {"experiment": "tiny", "scale": "350m", "variant": "dse", "stage": "pretrain"}
    world = {"seed": 7, "n_countries": 20, "n_people": 60, "n_filler": 500}   # tiny_data's world
    base = {"job": job, "source": "web", "manifest": tiny_data["manifests"]["web"], "baseline": "dense",
            "baseline_checkpoint": str(ckpts["dense"])}
    wf = AW.job_spec(cfg, "350m", "dse", "pretrain", "cka")
    assert wf["baseline_checkpoint"] == "results/tiny/350m/dense/pretrain/checkpoint" and wf["world"] == raw["world"]
    small = {**raw, "matrix": {"350m": {"variants": ["dense", "stem", "dse"], "stages": ["pretrain"]}}}
    mech = [t for t in AW.targets(C.experiment.parse(small, "tiny.yaml (350m)")) if t.rsplit("/", 1)[1] in ("logitlens.json", "cka.json", "dse_disabled.json")]
    assert sorted(mech) == [f"results/tiny/350m/dse/pretrain/analysis/{n}.json"
                            for n in ("cka", "dse_disabled", "logitlens")]   # DSE models only
    bad = copy.deepcopy(small)
    bad["analysis"]["cka"]["baseline"] = "hashmoe"
    with pytest.raises(ValueError, match="key 'analysis.cka.baseline' is 'hashmoe', which the tiny matrix does not"):
        AW.job_spec(C.experiment.parse(bad, "bad"), "350m", "dse", "pretrain", "cka")
    assert not [t for t in AW.targets(C.experiment.parse(bad, "bad")) if t.endswith("cka.json")]
    bad["analysis"]["dse_disabled"]["categories"]["context"] = ["triviaqa"]
    with pytest.raises(ValueError, match=r"categories.context': tasks \['triviaqa'\] are not in eval suite"):
        AW.job_spec(C.experiment.parse(bad, "bad"), "350m", "dse", "pretrain", "dse_disabled")
    ll = analyze(ckpts["dse"], {**base, "analysis": "logitlens", "windows": 3, "seq_len": 32}, tmp_path / "ll.json")
    assert len(ll["model"]["kl"]) == 3 and ll["model"]["kl"][-1] == 0 and ll["baseline_model"]["kl"][-1] == 0
    assert np.array(ll["model"]["window_kl"]).shape == (3, 3) and ll["tokens"] == 3 * 32
    # entity positions: the last token of " Name" where the windows hold it
    _, x = val_windows(tiny_data["manifests"]["web"], 64, 20)
    names = entity_names(make_world(**world))
    where = entity_positions(tok, names, x)
    assert len(where) >= 16
    for w, t in where[:20]:
        text = tok.decode(x[w, :t + 1].tolist())
        assert any(text.endswith(" " + nm) for nm in names), text[-40:]
    c = analyze(ckpts["dse"], {**base, "analysis": "cka", "world": world, "windows": 20, "seq_len": 64,
                               "tokens": "entities", "n_tokens": 64, "batch": 8, "topk": 2}, tmp_path / "cka.json")
    S = np.array(c["S"])
    assert S.shape == (3, 3) and c["n_tokens"] == min(64, len(where)) and len(c["alignment"]) == 3
    assert all(0 <= a <= 2 for a in c["alignment"])
    assert c["shift"] == pytest.approx(np.subtract(c["alignment"], c["self_alignment"]).tolist())
    # the reference: the baseline against itself has S = 1 on the diagonal, a_j^self from that matrix
    from stem.analysis.cka import features, minibatch_cka, soft_alignment
    from stem.analysis.common import load
    dense = load(ckpts["dense"])[0]
    fb = features(dense, val_windows(tiny_data["manifests"]["web"], 64, 20)[1], where[:c["n_tokens"]])
    Sself = minibatch_cka(fb, fb, 8)
    assert torch.allclose(torch.diagonal(Sself), torch.ones(3, dtype=torch.float64))
    assert c["self_alignment"] == pytest.approx(soft_alignment(Sself, 2))
    with pytest.raises(ValueError, match="tokens 'entities': needs the synthetic world"):
        analyze(ckpts["dse"], {**base, "analysis": "cka", "windows": 2, "seq_len": 16, "tokens": "entities",
                               "n_tokens": 8, "batch": 4, "topk": 2}, tmp_path / "x.json")
    assert not (tmp_path / "x.json").exists()
    fixtures.write_fixtures({"world": world, "seed": 0, "items": 6, "train_items": 2,
                             "tasks": ["arc_easy", "boolq"]}, tmp_path / "fx")
    ev = {**suite_spec(cfg, "commonsense"), "fixtures": str(tmp_path / "fx"), "batch_size": 8}
    d = analyze(ckpts["dse"], {"analysis": "dse_disabled", "job": job, "eval": ev, "modes": ["disabled"],
                               "categories": {"factual": ["arc_easy"], "context": ["boolq"]}}, tmp_path / "d.json")
    assert d["modes"] == ["normal", "disabled"] and len(d["items"]["disabled"]["boolq"]) == 6
    # the synthetic-world tasks: closed-book facts, and a counterfactual fact stated in the context
    from stem.analysis.dse_disabled import world_queries
    probe = {"items": 12, "choices": 3, "seed": 0}
    q = world_queries(make_world(**world), tok, probe)
    for (p, cands), (pc, cc) in zip(q["world_closed_book"], q["world_in_context"]):
        prompt, stated = tok.decode(p), tok.decode(cc[0])
        assert tok.decode(pc) == f"{prompt}{stated}. {prompt}" and len(cands) == len(cc) == 3
        assert tok.decode(cands[0]) not in [tok.decode(c) for c in cc]   # the true value is not a choice
    w = analyze(ckpts["dse"], {"analysis": "dse_disabled", "job": job, "eval": ev, "modes": ["forced"], "world": world,
                               "world_probe": probe, "categories": {"factual": ["world_closed_book"],
                                                                    "context": ["world_in_context"]}}, tmp_path / "w.json")
    for mode in ("normal", "forced"):
        for t in ("world_closed_book", "world_in_context"):
            hits = w["items"][mode][t]
            assert len(hits) == 12 and w["accuracy"][mode][t] == pytest.approx(100 * sum(hits) / 12)
    from stem.eval.harness import lm_eval_suite
    from stem.eval.lm import StemLM
    lm = StemLM(str(ckpts["dse"]), batch_size=8, dse_mode="disabled")
    assert {m.mode for m in lm.model.modules() if hasattr(m, "mode")} == {"disabled"}
    ref = lm_eval_suite(lm, {**ev, "tasks": ["arc_easy", "boolq"]})[0]["tasks"]
    assert d["accuracy"]["disabled"] == {t: ref[t]["value"] for t in ("arc_easy", "boolq")}
    row = next(r for r in d["retained"] if r["mode"] == "disabled" and r["task"] == "arc_easy")
    full = d["accuracy"]["normal"]["arc_easy"]
    assert row["retained"] == (pytest.approx(100 * d["accuracy"]["disabled"]["arc_easy"] / full) if full else None)
    with pytest.raises(ValueError, match="no DSE memory"):
        analyze(ckpts["dense"], {"analysis": "dse_disabled", "job": {**job, "variant": "dense"}, "eval": ev,
                                 "modes": ["disabled"], "categories": {"factual": ["arc_easy"]}}, tmp_path / "y.json")


# ---- tables, figures and directions (stem.report.mechanism) ---------------------------------------
def test_mechanism_tables_figures_and_directions_through_the_registry(tmp_path):
    """Hand-made analysis JSONs: table cells copied from them, the directions against the DSE paper's claims
    (a constructed case per verdict), each figure drawn; no results: empty tables, figures that say so."""
    import matplotlib.pyplot as plt

    from stem import config as C
    from stem.report.mechanism import mechanism_directions, retained_bootstrap
    from stem.report import registry
    from stem.report.figures import draw
    from stem.report.results import Results
    m = {**C.read_yaml(C.REPO / "config" / "tiny.yaml"), "matrix": {"350m": {"variants": ["dense", "dse"],
                                                                              "stages": ["pretrain"]}}}
    cfg = C.experiment.parse(m)
    ones = lambda k, n: [1.0] * k + [0.0] * (n - k)  # noqa: E731
    # factual: 20 -> 5 of 20 right when disabled (25% retained), 15 when forced (75%); context: 10 -> 10 (100%)
    items = {"normal": {"arc_easy": ones(20, 20), "boolq": ones(10, 20)},
             "disabled": {"arc_easy": ones(5, 20), "boolq": ones(10, 20)},
             "forced": {"arc_easy": ones(15, 20), "boolq": ones(10, 20)}}
    window = lambda *kl: [list(kl)] * 4  # noqa: E731
    bodies = {
        "logitlens": {"baseline": "dense", "model": {"layers": [0, 1, 2], "kl": [1.0, 0.5, 0.0], "window_kl": window(1.0, 0.5, 0.0)},
                      "baseline_model": {"layers": [0, 1, 2], "kl": [2.0, 1.0, 0.0], "window_kl": window(2.0, 1.0, 0.0)}},
        "cka": {"baseline": "dense", "S": [[0.9, 0.2, 0.1], [0.3, 0.8, 0.4], [0.1, 0.7, 0.9]], "alignment": [0.25, 1.5, 1.7],
                "self_alignment": [0.1, 1.0, 1.9], "shift": [0.15, 0.5, -0.2], "topk": 2, "n_tokens": 64,
                "tokens": "entities"},
        "dse_disabled": {"modes": ["normal", "disabled", "forced"], "categories": {"factual": ["arc_easy"], "context": ["boolq"]},
                         "items": items,
                         "retained": [{"mode": "disabled", "category": "factual", "task": "arc_easy", "accuracy": 25.0,
                                       "full_accuracy": 100.0, "retained": 25.0},
                                      {"mode": "forced", "category": "context", "task": "boolq", "accuracy": 50.0,
                                       "full_accuracy": 50.0, "retained": 100.0}]}}
    for name, body in bodies.items():
        p = tmp_path / f"results/tiny/350m/dse/pretrain/analysis/{name}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps({**body, "analysis": name, "scale": "350m", "variant": "dse", "stage": "pretrain"}))
    res = Results("tiny", tmp_path / "results")
    cell = lambda df, row, col: df[(df["row"] == row) & (df["column"] == col)]["value"].item()  # noqa: E731
    t = {n: registry.table(n) for n in ("logitlens", "cka", "dse_disabled")}
    assert not any(x.csv or x.compared for x in t.values())
    ll = t["logitlens"].build(cfg, res)
    assert cell(ll, "dse pretrain: dense", "L0") == 2.0 and cell(ll, "dse pretrain: dse", "L1") == 0.5
    assert ll["source"].iloc[0] == "results/tiny/350m/dse/pretrain/analysis/logitlens.json"
    ck = t["cka"].build(cfg, res)
    assert cell(ck, "dse pretrain: dense L2", "dse L1") == 0.7
    assert cell(ck, "dse pretrain: soft alignment a_j (top-2)", "dse L2") == 1.7
    assert cell(t["dse_disabled"].build(cfg, res), "dse pretrain: disabled factual arc_easy", "retained") == 25.0
    # retained % by hand: disabled factual 25, context 100 -> gap 75; forced factual 75 -> +50 over disabled
    r = json.loads((tmp_path / "results/tiny/350m/dse/pretrain/analysis/dse_disabled.json").read_text())
    ci = retained_bootstrap(r, lambda ret: ret["disabled", "context"] - ret["disabled", "factual"], n_boot=200)
    assert ci["delta"] == pytest.approx(75.0) and ci["lo"] > 0
    rows = {(x["table"], x["column"]): x for x in mechanism_directions(
        {n: {("350m", "dse", "pretrain"): json.loads((tmp_path / f"results/tiny/350m/dse/pretrain/analysis/{n}.json")
                                                      .read_text())} for n in bodies})}
    lens = next(x for (tb, _), x in rows.items() if tb == "logitlens")
    assert lens["ours_delta"] == pytest.approx(-0.75) and lens["verdict"] == "agree"   # (1 + .5)/2 - (2 + 1)/2
    assert next(x for (tb, _), x in rows.items() if tb == "cka")["ours_delta"] == pytest.approx(0.15)   # mean shift
    assert rows["dse_disabled", "retained % (DSE disabled): context - factual"]["verdict"] == "agree"
    assert rows["dse_disabled", "retained % of factual tasks: forced - disabled"]["ours_delta"] == pytest.approx(50.0)
    dirs = registry.table("directions").build(cfg, res)
    assert any("DSE paper App. G / Fig. 9" in s for s in dirs["source"])
    assert registry.figure("dse_cka").inputs(cfg, []) == {"analysis": ["results/tiny/350m/dse/pretrain/analysis/cka.json"]}
    for fig_name, name in (("dse_logitlens", "logitlens"), ("dse_cka", "cka"), ("dse_ablation", "dse_disabled")):
        files = {"analysis": [str(tmp_path / f"results/tiny/350m/dse/pretrain/analysis/{name}.json")]}
        fig = draw(fig_name, cfg, res, {}, files)
        assert any(line.get_xydata().size for ax in fig.axes for line in ax.get_lines()) or \
            any(ax.patches for ax in fig.axes)
        plt.close(fig)
    cfg = C.experiment.parse({k: v for k, v in m.items() if k != "analysis"})   # no analysis: section
    assert all(x.build(cfg, res).empty for x in t.values()) and t["cka"].inputs(cfg) == []
    fig = draw("dse_cka", cfg, res, {}, {"analysis": []})
    assert "config has no analysis.cka" in " ".join(x.get_text() for x in fig.axes[0].texts)
    plt.close(fig)
