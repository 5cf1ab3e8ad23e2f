"""Calibrated STEM tables (stem.models.calibrate; insert.init ``calibrated``, issue 41): the streamed closed form is
the per-row, per-coordinate weighted least squares, the unseen rule fills the rest, sequential calibration sees the
earlier STEM layers, and bad input is refused in one line."""
import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from stem.models.calibrate import calibrate
from stem.models.spec import ModelConfig
from stem.models.insert import insert_stem
from stem.models.model import build_model

CFG = ModelConfig(vocab_size=97, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48, max_seq_len=64)


@pytest.fixture(scope="module")
def dense():
    torch.manual_seed(5)
    return build_model(CFG).eval()


def ffn_inputs(model, x, layer):
    """(s, u) of layer ``layer`` at every position of ``x``: SiLU(W_g h), W_up h (h the FFN input)."""
    got = []
    hook = model.layers[layer].ffn.register_forward_hook(lambda m, a, o: got.append(a[0]))
    with torch.no_grad():
        model(x)
    hook.remove()
    ffn = model.layers[layer].ffn
    h = got[0].reshape(-1, CFG.d_model)
    with torch.no_grad():
        return F.silu(ffn.w_gate(h)), ffn.w_up(h)


def test_closed_form_is_the_gated_least_squares(dense):
    """Row t, coordinate j: argmin_U sum_n (s_nj (U - u_nj))^2 by torch.linalg.lstsq on t's occurrences equals the
    calibrated table (batched over coordinates); the plain mean of u (no gate weighting) is measurably not it."""
    x = torch.randint(0, 40, (6, 32))
    cal = calibrate(dense, x, [1, 3], batch=4, log=lambda m: None)
    for layer in (1, 3):
        s, u = ffn_inputs(dense, x, layer)
        ids = x.reshape(-1)
        worst_plain = 0.0
        for t in ids.unique()[:12]:
            occ = ids == t
            a = s[occ].T.unsqueeze(-1)                       # (d_ff, n, 1): the design, per coordinate
            b = (s[occ] * u[occ]).T.unsqueeze(-1)            # (d_ff, n, 1)
            brute = torch.linalg.lstsq(a.double(), b.double()).solution.reshape(-1).float()
            got = cal.table(layer, t.reshape(1), dense.state_dict())[0]
            torch.testing.assert_close(got, brute, rtol=1e-4, atol=1e-5)
            if occ.sum() > 1:
                worst_plain = max(worst_plain, (u[occ].mean(0) - brute).abs().max().item())
        assert worst_plain > 1e-2   # the weighting matters: an unweighted mean would fail the comparison above


def test_unseen_rule_and_whole_table(dense):
    """Tokens the calibration never saw: ``mean`` = the gate-weighted mean over all calibration tokens, ``raw`` =
    E[t] W_up^T; the inserted model's whole table is the calibration's rows; coverage counts calibrated tokens."""
    x = torch.randint(0, 40, (4, 32))
    state = dense.state_dict()
    for unseen in ("mean", "raw"):
        cal = calibrate(dense, x, [1], unseen=unseen, log=lambda m: None)
        s, u = ffn_inputs(dense, x, 1)
        never = torch.tensor([90])
        want = ((s ** 2 * u).sum(0) / (s ** 2).sum(0) if unseen == "mean"
                else F.linear(state["tok_emb.weight"][never].float(), state["layers.1.ffn.w_up.weight"])[0])
        torch.testing.assert_close(cal.table(1, never, state)[0], want, rtol=1e-4, atol=1e-5)
        model = build_model(dataclasses.replace(CFG, ffn=("dense", "stem", "dense", "dense"))).eval()
        insert_stem(model, state, "calibrated", calibration=cal)
        torch.testing.assert_close(model.layers[1].ffn.table.weight.data, cal.table(1, torch.arange(97), state))
    assert cal.coverage(torch.tensor([1, 2, 95, 96])) == pytest.approx(
        sum(int((x == t).any()) for t in (1, 2, 95, 96)) / 4)


def test_sequential_sees_the_earlier_stem_layers(dense):
    """Sequential calibration of [1, 3]: layer 1 as in one pass; layer 3 as calibrated in the model where layer 1 is
    already STEM with its calibrated table (and not as in one pass)."""
    x = torch.randint(0, 40, (4, 32))
    state = dense.state_dict()
    quiet = dict(log=lambda m: None)
    once, seq = calibrate(dense, x, [1, 3], **quiet), calibrate(dense, x, [1, 3], sequential=True, **quiet)
    torch.testing.assert_close(seq.rows[1], once.rows[1])
    first = build_model(dataclasses.replace(CFG, ffn=("dense", "stem", "dense", "dense"))).eval()
    insert_stem(first, state, "calibrated", calibration=once)
    torch.testing.assert_close(seq.rows[3], calibrate(first, x, [3], **quiet).rows[3], rtol=1e-4, atol=1e-5)
    assert (seq.rows[3] - once.rows[3]).abs().max() > 1e-4   # 10 x the tolerance of the equality above


def test_calibrated_is_closer_to_dense_than_raw(dense):
    """On the calibration windows themselves, the calibrated insertion's loss is nearer the dense model's than
    ``raw``'s (the statistic is fitted to what the dense layer computed there)."""
    x = torch.randint(0, 40, (4, 33))
    cal = calibrate(dense, x[:, :-1], [1, 2], log=lambda m: None)
    cfg = dataclasses.replace(CFG, ffn=("dense", "stem", "stem", "dense"))
    with torch.no_grad():
        ref = dense(x[:, :-1])
        gaps = {}
        for init in ("calibrated", "raw"):
            m = build_model(cfg).eval()
            insert_stem(m, dense.state_dict(), init, calibration=cal)
            gaps[init] = (m(x[:, :-1]) - ref).pow(2).mean().item()
    assert gaps["calibrated"] < 0.5 * gaps["raw"]


def test_bad_input_is_one_line(dense, tmp_path):
    from stem.analysis.insertion import calibration_windows, step0_rows
    cfg = dataclasses.replace(CFG, ffn=("dense", "stem", "dense", "dense"))
    with pytest.raises(ValueError, match="'calibrated' without a calibration source"):
        insert_stem(build_model(cfg), dense.state_dict(), "calibrated")
    with pytest.raises(ValueError, match="'calibrated' without a calibration source"):
        step0_rows(dense, torch.randint(0, 40, (2, 9)), {"a": [1]}, ["calibrated"])
    with pytest.raises(ValueError, match=r"calibration layers \[7\]: outside the model's 4 layers"):
        calibrate(dense, torch.randint(0, 40, (2, 8)), [1, 7], log=lambda m: None)
    with pytest.raises(ValueError, match=r"placement \[1, 9\]: layers \[9\] outside"):
        step0_rows(dense, torch.randint(0, 40, (2, 9)), {"a": [1, 9]}, ["calibrated"], cal={"x": None})
    ours, other = tmp_path / "a.json", tmp_path / "b.json"
    ours.write_text(json.dumps({"tokenizer_sha256": "aa", "vocab_size": 97}))
    other.write_text(json.dumps({"tokenizer_sha256": "bb", "vocab_size": 97}))
    with pytest.raises(ValueError, match=r"calibration.manifest: .*b.json: tokenizer_sha256 'bb', expected 'aa'"):
        calibration_windows(ours, other, 64, 8, 97)
    with pytest.raises(ValueError, match=r"calibration.manifest: .*nope.json: no such file"):
        calibration_windows(ours, tmp_path / "nope.json", 64, 8, 97)


def test_a_trained_calibrated_insertion_gets_its_calibration_source_in_the_job_spec():
    """A variant with insert.init calibrated: the train job's spec carries the calibration source's manifest (the
    stage's first data source by default) and settings; the step-0 analysis's calibration settings are checked key
    by key, its compare / per_layer lists name placements."""
    import copy
    from stem import config as C
    raw = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    raw.setdefault("variant_overrides", {})["stem_insert"] = {"insert": {"init": "calibrated",
                                                                         "calibration": {"tokens": 512}}}
    exp = C.experiment.parse(copy.deepcopy(raw), "tiny.yaml")
    spec = C.train_spec(exp, "1b", "stem_insert", "midtrain")
    src = next(iter(spec["data"]))
    assert spec["insert"]["calibration"] == {"source": src, "manifest": spec["data"][src]["manifest"], "tokens": 512,
                                             "unseen": "mean", "sequential": False}
    real = C.read_yaml(C.REPO / "config" / "real.yaml")
    for cal, message in [({"unseen": "never"}, r"calibration.unseen': 'never'; expected mean or raw"),
                         ({"compare": ["2/3"]}, r"calibration.compare': '2/3' is not a placement"),
                         ({"per_layer": ["x"]}, r"calibration.per_layer': 'x' is not a placement")]:
        bad = copy.deepcopy(real)
        bad["analysis"]["insertion_step0"]["calibration"] = cal
        with pytest.raises(C.ConfigError, match=message):
            C.experiment.parse(bad, "real.yaml")


def test_step0_rows_calibrated_with_the_per_layer_decomposition(dense):
    """The step-0 analysis: a placement's calibrated row, then one row per STEM layer inserted alone (calibrated),
    and the record of the calibration (rows calibrated, held-out coverage of the lookups)."""
    from stem.analysis.insertion import step0_rows
    x = torch.randint(0, 60, (2, 17))
    cal = {"x": torch.randint(0, 40, (4, 16)), "per_layer": True}
    rows = step0_rows(dense, x, {"p": [1, 3]}, ["calibrated", "raw"], cal=cal)
    assert [(r["placement"], r["init"]) for r in rows] == [("dense", None), ("p", "calibrated"), ("p", "raw"),
                                                          ("layer 1", "calibrated"), ("layer 3", "calibrated")]
    rec = cal["record"]
    assert rec["rows_calibrated"] == len(cal["x"].unique())
    assert rec["heldout_coverage"] == pytest.approx(float(
        torch.isin(x[:, :-1], cal["x"]).float().mean()))


def test_step0_compare_rows_and_the_trained_insertion_takes_the_best(dense, tmp_path):
    """calibration.compare adds the other choices (unseen raw, sequential) at a placement, equal to calibrating with
    them directly; stem.train.calibration.best_choice picks the lowest at the trained layers, and refuses layers the
    analysis has no calibrated row for, in one line."""
    from stem.analysis.insertion import step0_rows
    from stem.train.calibration import best_choice
    x = torch.randint(0, 60, (2, 17))
    cal = {"x": torch.randint(0, 40, (4, 16)), "compare": ["p"], "per_layer": ["p"]}
    rows = step0_rows(dense, x, {"p": [1, 3], "q": [2]}, ["calibrated"], cal=cal)
    got = [(r["placement"], r.get("choice")) for r in rows[1:]]
    assert got == [("p", None), ("q", None), ("p", {"unseen": "mean", "sequential": True}),
                   ("p", {"unseen": "raw", "sequential": False}), ("p", {"unseen": "raw", "sequential": True}),
                   ("layer 1", None), ("layer 3", None)]
    seq = step0_rows(dense, x, {"p": [1, 3]}, ["calibrated"], cal={"x": cal["x"], "sequential": True,
                                                                      "unseen": "raw"})
    assert seq[1]["window_loss"] == rows[5]["window_loss"]
    path = tmp_path / "step0.json"
    path.write_text(json.dumps({"rows": rows, "calibration": cal["record"]}))
    best = best_choice(path, [1, 3])
    assert best["heldout_loss"] == min(r["mean_loss"] for r in rows if r["placement"] == "p")
    assert len(best["compared"]) == 4
    with pytest.raises(ValueError, match=r"insert.calibration.step0: .*step0.json: no calibrated row at STEM "
                                         r"layers \[0, 1\]"):
        best_choice(path, [0, 1])


def test_windows_of_several_lengths_calibrate_as_one_text(dense):
    """calibrate on a list of (B, T) tensors (the source's windows and the entity texts, stem.train.entity_text): the
    same tables as on their windows stacked; a token only in the shorter texts gets the rows those texts alone give."""
    x, y = torch.randint(0, 40, (6, 32)), torch.randint(60, 70, (3, 11))
    whole, state = calibrate(dense, x, [1, 3], log=lambda m: None), dense.state_dict()
    both = calibrate(dense, [x[:2], x[2:], y], [1, 3], log=lambda m: None)
    alone = calibrate(dense, y, [1, 3], log=lambda m: None)
    for layer in (1, 3):
        torch.testing.assert_close(both.table(layer, x.unique(), state), whole.table(layer, x.unique(), state))
        torch.testing.assert_close(both.table(layer, y.unique(), state), alone.table(layer, y.unique(), state))


def test_entity_texts_config_bad_input_is_one_line():
    """insert.calibration.entities: the job spec carries its settings, the facts file's path and the entity_text
    job's output (the dense checkpoint's stage folder); a prompt without {e}, a missing facts file: one line."""
    import copy
    from stem import config as C
    real = C.read_yaml(C.REPO / "config" / "real.yaml")
    exp = C.experiment.parse(copy.deepcopy(real), "real.yaml")
    ent = C.train_spec(exp, "350m", "stem_insert", "midtrain")["insert"]["calibration"]["entities"]
    assert ent["out"] == "results/real/350m/dense/pretrain/entity_text.json" and ent["facts"].endswith("facts.yaml")
    assert C.entity_text_spec(exp, "350m", "dense", "pretrain") == {k: v for k, v in ent.items() if k != "out"}
    where = real["variant_overrides"]["stem_insert"]["insert"]["calibration"]
    for key, value, message in [("prompts", ["no entity"], r"calibration.entities.prompts': .*each with \{e\}"),
                                ("facts", "nope.yaml", r"calibration.entities.facts': 'nope.yaml': no such file")]:
        bad = copy.deepcopy(real)
        bad["variant_overrides"]["stem_insert"]["insert"]["calibration"]["entities"] = {**where["entities"],
                                                                                        key: value}
        with pytest.raises(C.ConfigError, match=message):
            C.train_spec(C.experiment.parse(bad, "real.yaml"), "350m", "stem_insert", "midtrain")
