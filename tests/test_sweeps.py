"""The DSE paper's Sec. 3 sweeps (stem.sweeps, rules/sweep.smk): parameter arithmetic against a hand computation
and the built models, the rho -> (experts, rows) construction at iso P_tot / P_act, the log-linear fit, variant ids
and their validation, the sweep's collection from training summaries, and a dry run of both targets."""
import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import job_counts
from stem import config as C
from stem import provenance
from stem import sweeps as S
from stem.seeds import JobId
from stem.report import sweeps as SR

REPO = Path(__file__).resolve().parents[1]


def _naive_primes(start, n):
    """The first n primes >= start by trial division (independent of stem.sweeps and stem.models.dse)."""
    out, k = [], start
    while len(out) < n:
        if k > 1 and all(k % p for p in range(2, math.isqrt(k) + 1)):
            out.append(k)
        k += 1
    return out


def tiny_cfg(**sweeps) -> dict:
    """config/tiny.yaml (its routed MoE: 1 shared + top-2 of 8 experts of width 64) with ``sweeps`` instead of its own."""
    cfg = copy.deepcopy(C.read_yaml(REPO / "config" / "tiny.yaml"))
    assert cfg["variant_overrides"]["moe"] == {"moe_experts": 8, "moe_shared": 1, "moe_top_k": 2, "moe_d_ff": 64}
    base = {"scale": "350m", "stage": "pretrain", "train": {"steps": 100}}
    cfg["sweeps"] = {**base, **sweeps}
    return cfg


RHO = {"base": "moe", "memory": "dse", "dse": {"d_mem": 32}, "values": [1.0, 0.833, 0.667, 0.5, 0.333],
       "tolerance": {"p_tot": 0.001, "p_act": 0.035}}
SLOTS = {"base": "dense", "memory": "dse", "rows_per_head": [64, 256, 1024]}


# ---- parameter arithmetic ------------------------------------------------------------------------------------
def test_counts_against_a_hand_computation():
    """Tiny 350m arch (d 64, 4 heads of 16, 2 kv heads, d_ff 192, 6 layers), embedding and head excluded:
    attention 64*64 + 2*64*32 + 64*64 = 12,288 and norms 128 per layer, dense FFN 3*64*192 = 36,864,
    final norm 64 -> dense 6 * 49,280 + 64 = 295,744 (= 557,888 total - 2 * 2048 * 64)."""
    arch = C.read_yaml(REPO / "config" / "tiny.yaml")["archs"]["350m"]
    dense = S.counts({**arch, "ffn": ()})
    assert (dense.p_tot, dense.p_act, dense.p_free) == (295_744, 295_744, 0)
    # DSE at layers 1 and 3, orders (2, 3) x 4 heads = 8 tables of 64 / 8 = 8 dims; rows: the first 8 primes
    # >= 64 = 67 + 71 + 73 + 79 + 83 + 89 + 97 + 101 = 660 per layer; per layer w_key + w_value 2 * 64 * 64,
    # conv 64 * 4, three norms 3 * 64 = 8,640 active
    dse = S.counts({**arch, "ffn": (), "dse": {"layers": [1, 3], "orders": [2, 3], "heads": 4, "rows_per_head": 64,
                                               "d_mem": 64}})
    assert (dse.dse_slots, dse.dse_tables) == (2 * 660, 2 * 660 * 8)
    assert (dse.p_act, dse.p_tot) == (295_744 + 2 * 8_640, 295_744 + 2 * 8_640 + 10_560)
    # MoE in layers 1..5: experts 3 * 64 * 64 = 12,288 each; per layer (1 shared + 8) experts + router 64 * 8 =
    # 111,104 in total, (1 shared + top-2) experts + router = 37,376 active, 6 routed experts idle
    moe = S.counts({**arch, "ffn": ("dense",) + ("moe",) * 5, "moe_experts": 8, "moe_shared": 1, "moe_top_k": 2,
                    "moe_d_ff": 64})
    assert moe.p_tot == 295_744 - 5 * 36_864 + 5 * 111_104 == 666_944
    assert moe.p_act == 295_744 - 5 * 36_864 + 5 * 37_376 == 298_304
    assert moe.moe_free == moe.p_free == 5 * 6 * 12_288
    with pytest.raises(S.SweepError, match="ffn kind 'stem': the sweep's parameter arithmetic knows dense and moe"):
        S.counts({**arch, "ffn": ("stem",) * 6})


def test_table_rows_are_the_dse_modules_primes():
    from stem.models.spec import DSEConfig, ModelConfig
    from stem.models.dse import DSEMemory
    for start, n in [(2, 4), (64, 8), (1021, 16), (65536, 16)]:   # n tables = 2 orders x n / 2 heads, 1 dim each
        cfg = ModelConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=1, n_kv_heads=1, d_ff=8, max_seq_len=8,
                          dse=DSEConfig(layers=(0,), heads=n // 2, rows_per_head=start, d_mem=n))
        assert list(S.table_rows(start, n)) == DSEMemory(cfg, 0).primes.tolist()
    assert list(S.table_rows(64, 8)) == _naive_primes(64, 8)


def test_counts_match_the_built_models():
    """P_tot / P_act of every slots point = the model the train rule builds, less the embedding and LM head."""
    from stem.models.accounting import accounting
    from stem.models.model import build_model
    exp = C.experiment.parse(tiny_cfg(slots=SLOTS))
    for p in S.slots_points(S.spec(exp)):
        mc = C.model_config_for(exp, "350m", p["variant"], "pretrain")
        a, emb = accounting(build_model(mc, "meta")), 2 * mc.vocab_size * mc.d_model
        assert (a["total_params"] - emb, a["active_params"] - emb) == (p["p_tot"], p["p_act"])
        assert mc.dse.rows_per_head == p["rows_per_head"]


def test_rho_counts_match_the_built_moe_models():
    from stem.models.accounting import accounting
    from stem.models.model import build_model
    exp = C.experiment.parse(tiny_cfg(rho=RHO))
    for p in S.rho_points(S.spec(exp)):
        mc = C.model_config_for(exp, "350m", p["variant"], "pretrain")
        a, emb = accounting(build_model(mc, "meta")), 2 * mc.vocab_size * mc.d_model
        assert (a["total_params"] - emb, a["active_params"] - emb) == (p["p_tot"], p["p_act"]), p["variant"]


def test_rho_points_keep_p_tot_and_p_act():
    """Each rho: E' = 2 + round(6 rho) routed experts, DSE rows nearest the rho = 1 model's P_tot; P_tot and P_act
    re-derived by hand from (E', rows) and within the stated tolerance of the pure MoE's."""
    cfg = tiny_cfg(rho=RHO)
    pts = S.rho_points(cfg)
    assert [p["variant"] for p in pts] == ["rho_1", "rho_0p833", "rho_0p667", "rho_0p5", "rho_0p333"]
    assert [p["moe_experts"] for p in pts] == [8, 7, 6, 5, 4]

    def hand(experts, rows):   # tiny 350m arch; d 64, expert 3 * 64 * 64; DSE d_mem 32 at layers 1, 3; 8 tables of 4
        backbone = 295_744 - 5 * 36_864 + 5 * 64 * experts
        tot, act = backbone + 5 * (1 + experts) * 12_288, backbone + 5 * 3 * 12_288
        if rows:
            proj = 2 * (2 * 32 * 64 + 4 * 64 + 3 * 64)
            tot, act = tot + proj + 2 * 4 * sum(_naive_primes(rows, 8)), act + proj
        return tot, act
    ref_tot, ref_act = hand(8, 0)
    assert (ref_tot, ref_act) == (666_944, 298_304)
    for p in pts:
        assert p["rows_per_head"] == 0 if p["rho"] == 1 else p["rows_per_head"] > 0
        assert (p["p_tot"], p["p_act"]) == hand(p["moe_experts"], p["rows_per_head"])
        assert abs(p["p_tot"] - ref_tot) / ref_tot <= 0.001 and abs(p["p_act"] - ref_act) / ref_act <= 0.035
        assert p["p_tot_dev"] == (p["p_tot"] - ref_tot) / ref_tot and p["p_act_dev"] == (p["p_act"] - ref_act) / ref_act
        assert p["moe_free"] == 5 * (p["moe_experts"] - 2) * 12_288
        assert p["rho_actual"] == pytest.approx(p["moe_free"] / (p["p_tot"] - p["p_act"]))
        if p["rows_per_head"]:   # the nearest: the next table sets down and up are farther from the target
            r = p["rows_per_head"]
            below = max(k for k in range(r - 100, r) if _naive_primes(k, 1)[0] == k)   # adds a smaller prime
            above = _naive_primes(r, 1)[0] + 1                                            # drops the smallest
            for k in (below, above):
                assert hand(p["moe_experts"], k)[0] != p["p_tot"]
                assert abs(hand(p["moe_experts"], k)[0] - ref_tot) >= abs(p["p_tot"] - ref_tot)


# ---- the fit ---------------------------------------------------------------------------------------------------
def test_loglinear_fit_of_an_exact_series():
    x = [1_000, 4_000, 16_000, 64_000, 256_000]
    f = SR.fit_loglinear(x, [3.5 - 0.042 * math.log10(v) for v in x])
    assert f["slope_per_decade"] == pytest.approx(-0.042, abs=1e-12) and f["intercept"] == pytest.approx(3.5)
    assert f["r2"] == pytest.approx(1.0) and f["n"] == 5
    noisy = SR.fit_loglinear(x, [3.0, 2.9, 2.95, 2.7, 2.75])   # numpy's polyfit of the same points, by hand:
    lx = [math.log10(v) for v in x]
    mx, my = sum(lx) / 5, sum([3.0, 2.9, 2.95, 2.7, 2.75]) / 5
    b = sum((a - mx) * (c - my) for a, c in zip(lx, [3.0, 2.9, 2.95, 2.7, 2.75])) / sum((a - mx) ** 2 for a in lx)
    assert noisy["slope_per_decade"] == pytest.approx(b) and 0 < noisy["r2"] < 1
    with pytest.raises(ValueError, match="at least two distinct x values"):
        SR.fit_loglinear([10, 10], [1.0, 2.0])


# ---- ids and validation ----------------------------------------------------------------------------------------
def test_variant_ids():
    assert [S.rho_id(r) for r in (1.0, 1, 0.75, 0.8, 0.833, 0.05, 0)] == \
        ["rho_1", "rho_1", "rho_0p75", "rho_0p8", "rho_0p833", "rho_0p05", "rho_0"]
    assert S.slots_id(4093) == "slots_4093"
    assert all(JobId.parse("350m", v, "pretrain").sweep for v in ("rho_0p75", "rho_1", "slots_4093"))
    assert not any(JobId.parse("350m", v, "pretrain").sweep for v in ("dse", "rho_", "rho_0.75", "slots_x", "stem_half"))
    for bad in (0.8333, 1.5, -0.1):
        with pytest.raises(S.SweepError, match=r"expected a number in \[0, 1\] with at most three decimals"):
            S.rho_id(bad)


def test_train_spec_of_a_sweep_point():
    cfg = tiny_cfg(slots=SLOTS)
    exp = C.experiment.parse(cfg)
    spec = C.train_spec(exp, "350m", "slots_256", "pretrain")
    assert spec["train"]["steps"] == 100 and spec["variant"] == "slots_256"
    assert spec["out_dir"] == "results/tiny/350m/slots_256/pretrain"
    assert spec["model"]["dse"]["rows_per_head"] == 256 and spec["model"]["dse"]["layers"] == [1, 3]
    assert set(spec["model"]["ffn"]) == {"dense"}
    # a named variant is unchanged by the sweeps: section
    plain = C.read_yaml(REPO / "config" / "tiny.yaml")
    plain.pop("sweeps", None)
    assert C.train_spec(exp, "350m", "dse", "pretrain") == C.train_spec(C.experiment.parse(plain), "350m", "dse",
                                                                         "pretrain")
    # the sweep's scale need not be in the matrix
    cfg["matrix"].pop("350m")
    exp = C.experiment.parse(cfg, "tiny.yaml (no 350m in the matrix)")
    assert C.train_spec(exp, "350m", "slots_256", "pretrain") == spec
    with pytest.raises(C.ConfigError, match=r"^variant 'slots_256': a sweep point, trained at sweeps.scale / "
                                            r"sweeps.stage \(350m / pretrain\), not at 1b / pretrain$"):
        C.train_spec(exp, "1b", "slots_256", "pretrain")
    with pytest.raises(C.ConfigError, match=r"^variant 'slots_100': not a point of the config's sweeps: section "
                                            r"\(expected one of slots_64, slots_256, slots_1024\)$"):
        C.train_spec(exp, "350m", "slots_100", "pretrain")


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.update(stage="extend"), "key 'sweeps.stage': 'extend' at scale '350m' is not in stages; expected "
                                         "a stage trained from scratch"),
    (lambda s: s.update(scale="1b", stage="midtrain"), "key 'sweeps.stage': 'midtrain' at scale '1b' starts from "
                                                       "'pretrain'; expected a stage trained from scratch"),
    (lambda s: s["slots"].update(rows_per_head=[256, 64]), "key 'sweeps.slots.rows_per_head': [256, 64]: expected "
                                                           "strictly increasing values"),
    (lambda s: s["slots"].update(rows_per_head=[1, 64]), "key 'sweeps.slots.rows_per_head': [1, 64]; expected at least 2 integers >= 2"),
    (lambda s: s["slots"].update(base="dse"), "key 'sweeps.slots.base': variant 'dse' already has a DSE memory"),
    (lambda s: s["slots"].update(memory="stem"), "key 'sweeps.slots.memory': variant 'stem' has no dse: section"),
    (lambda s: s["slots"].update(dse={"d_mem": 30}), "key 'sweeps.slots.dse': d_mem 30 (memory 'dse' with "
                                                             "sweeps.slots.dse over it) must divide evenly over its 8"),
    (lambda s: s.update(train={"stepz": 5}), "key 'sweeps.train.stepz': unknown; expected one of steps, eval_batches"),
])
def test_bad_slots_section_is_a_one_line_error(edit, message):
    cfg = tiny_cfg(slots=copy.deepcopy(SLOTS))
    edit(cfg["sweeps"])
    with pytest.raises(C.ConfigError) as e:
        C.experiment.parse(cfg, origin="tiny.yaml")
    assert message in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("tiny.yaml: ")


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(values=[1.0, 0.8, 0.833]), "key 'sweeps.rho.values': rho 0.833 and 0.8 both give 7 routed "
                                                   "experts"),
    (lambda r: r.update(values=[0.95, 0.5]), "rho 0.95 keeps all 8 routed experts (steps of 1/6), so nothing is left "
                                             "for the memory; expected rho <= 0.917 or 1"),
    (lambda r: r.update(values=[1.0, 0.8333]), "key 'sweeps.rho.values': rho 0.8333: expected a number in [0, 1] "
                                               "with at most three decimals"),
    (lambda r: r.update(base="dense"), "key 'sweeps.rho.base': variant 'dense' has ffn 'dense'; expected a variant "
                                       "with ffn moe"),
    (lambda r: r.update(dse={}), "key 'sweeps.rho.values': rho 0.833 gives P_act 315,264, +5.69% from the rho = 1 "
                                 "model's 298,304; expected within sweeps.rho.tolerance.p_act = 0.035"),
    (lambda r: r.update(tolerance={"p_tot": 0.0}), "gives P_tot"),
])
def test_bad_rho_section_is_a_one_line_error(edit, message):
    cfg = tiny_cfg(rho=copy.deepcopy(RHO))
    edit(cfg["sweeps"]["rho"])
    with pytest.raises(S.SweepError) as e:
        S.rho_points(cfg)
    assert message in str(e.value) and "\n" not in str(e.value)


# ---- collecting a sweep ----------------------------------------------------------------------------------------
def _summary(cfg, variant, p, loss):
    V, d = 2048, 64
    return {"experiment": "tiny", "scale": "350m", "variant": variant, "stage": "pretrain", "final_val_loss": loss,
            "final_train_loss": loss + 0.1, "steps": 100, "tokens": 204_800, "wall_seconds": 30.0,
            "total_params": p["p_tot"] + 2 * V * d, "active_params": p["p_act"] + 2 * V * d}


def test_collect_slots_writes_the_fit_and_refuses_a_wrong_model(tmp_path):
    cfg = tiny_cfg(slots=SLOTS)
    pts = S.slots_points(cfg)
    losses = [3.6 - 0.05 * math.log10(p["dse_slots"]) for p in pts]
    for p, loss in zip(pts, losses):
        path = tmp_path / "tiny/350m" / p["variant"] / "pretrain/summary.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(_summary(cfg, p["variant"], p, loss)))
    r = SR.collect(cfg, "slots", tmp_path)
    assert r["fit"]["slope_per_decade"] == pytest.approx(-0.05) and r["fit"]["r2"] == pytest.approx(1.0)
    assert [x["val_loss"] for x in r["points"]] == losses and r["label"].startswith("experiment: tiny")
    assert r["provenance"]["spec_sha256"] == provenance.spec_hash(cfg)   # issue 32: the sweep JSON has provenance
    md = SR.markdown(r)
    assert "b = **-0.0500** per decade" in md and "| slots_64 | 64 | 1,320 |" in md
    from stem.report.figures import save
    save(SR.figure(r), tmp_path / "slots.png")
    assert (tmp_path / "slots.png").stat().st_size > 10_000
    # the report's figure: drawn from the sweep's JSON when sweeps.in_all asks for it, a placeholder otherwise
    from stem.report import figures as F
    from stem.report import registry
    (tmp_path / "slots.json").write_text(json.dumps(r))
    exp = C.experiment.parse(cfg)
    assert registry.figure("sweep_slots").inputs(exp, []) == {}
    in_all = C.experiment.parse({**cfg, "sweeps": {**cfg["sweeps"], "in_all": True}})
    assert registry.figure("sweep_slots").inputs(in_all, []) == {"sweep": "reports/tiny/sweeps/slots.json"}
    for files in ({"sweep": str(tmp_path / "slots.json")}, {}):
        save(F.draw("sweep_slots", exp, None, {}, files), tmp_path / "fig.png")
        assert (tmp_path / "fig.png").stat().st_size > 10_000
    bad = tmp_path / "tiny/350m/slots_256/pretrain/summary.json"
    s = json.loads(bad.read_text())
    bad.write_text(json.dumps({**s, "total_params": s["total_params"] + 1}))
    with pytest.raises(ValueError, match=r"slots_256/pretrain/summary.json: key 'total_params': .* is not the sweep's"):
        SR.collect(cfg, "slots", tmp_path)
    bad.write_text(json.dumps({**s, "active_params": s["active_params"] - 64}))
    with pytest.raises(ValueError, match=r"slots_256/pretrain/summary.json: key 'active_params': .* \(P_act 313,024 "):
        SR.collect(cfg, "slots", tmp_path)
    bad.unlink()
    with pytest.raises(ValueError, match="slots_256/pretrain/summary.json: missing"):
        SR.collect(cfg, "slots", tmp_path)


def test_collect_rho_marks_the_optimum(tmp_path):
    cfg = tiny_cfg(rho=RHO)
    pts = S.rho_points(cfg)
    losses = {"rho_1": 3.40, "rho_0p833": 3.35, "rho_0p667": 3.37, "rho_0p5": 3.41, "rho_0p333": 3.50}
    for p in pts:
        path = tmp_path / "tiny/350m" / p["variant"] / "pretrain/summary.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(_summary(cfg, p["variant"], p, losses[p["variant"]])))
    r = SR.collect(cfg, "rho", tmp_path)
    assert r["optimum"]["variant"] == "rho_0p833" and r["optimum"]["gain_vs_pure_moe"] == pytest.approx(0.05)
    assert r["target"] == {"p_tot": 666_944, "p_act": 298_304}
    assert "Lowest validation loss: **rho_0p833**" in SR.markdown(r)
    from stem.report.figures import save
    save(SR.figure(r), tmp_path / "rho.png")
    assert (tmp_path / "rho.png").stat().st_size > 10_000


# ---- the workflow ------------------------------------------------------------------------------------------------
def test_dry_run_of_both_sweep_targets(tmp_path):
    """`snakemake -n sweep_rho sweep_slots` on config/tiny.yaml: one training job per point, one collection per
    sweep, the targets (and the data jobs of a fresh folder)."""
    cfg = yaml.safe_load((REPO / "config/tiny.yaml").read_text())
    n_rho, n_slots = len(cfg["sweeps"]["rho"]["values"]), len(cfg["sweeps"]["slots"]["rows_per_head"])
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "-d", str(tmp_path), "-n", "--cores", "2"]
    r = subprocess.run([*cmd, "sweep_rho", "sweep_slots"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    counts = job_counts(r.stdout)
    assert (counts["train"], counts["sweep_report"], counts["sweep_rho"], counts["sweep_slots"]) == \
        (n_rho + n_slots, 2, 1, 1)
    assert "results/tiny/350m/rho_0p833/pretrain/summary.json" in r.stdout
    assert "reports/tiny/sweeps/slots.png" in r.stdout


@pytest.mark.parametrize("name", ["tiny", "paper"])
def test_the_sweep_spec_of_the_tree_gives_the_sweep_jobs_points(name):
    """The workflow's points (``spec`` of the typed tree) are the sweep_report job's (its --spec: the config's
    experiment, archs, variant_overrides and sweeps as written, rules/sweep.smk)."""
    raw = C.read_yaml(REPO / "config" / f"{name}.yaml")
    job = {k: raw[k] for k in ("experiment", "archs", "variant_overrides", "sweeps") if k in raw}
    tree = S.spec(C.experiment.parse(raw, f"{name}.yaml"))
    assert tree.keys() == job.keys()
    for kind in S.KINDS:
        assert S.points(tree, kind) == S.points(job, kind) and S.variant_ids(tree, kind)


def test_paper_sweeps_at_the_350m_arch():
    """config/paper.yaml: the sweeps' MoE backbone (base_overrides: 1 shared + top-3 of 49 experts of 640) by hand,
    d 960, 31 MoE layers: dense 350M without embedding / head 314,635,200; per MoE layer experts 3 * 960 * 640 =
    1,843,200 each and router 960 * 49 replace the dense FFN 3 * 960 * 2560 = 7,372,800. Every rho point is within
    its tolerance (strict) and the slots span the paper's 2.58e5 .. 1e7."""
    cfg = C.experiment.load(REPO / "config" / "paper.yaml")
    rho = S.rho_points(S.spec(cfg))
    e, router, ffn = 1_843_200, 960 * 49, 7_372_800
    assert (rho[0]["p_tot"], rho[0]["p_act"]) == (314_635_200 + 31 * (50 * e + router - ffn),
                                                  314_635_200 + 31 * (4 * e + router - ffn)) == (2_944_496_640, 316_093_440)
    assert [p["moe_experts"] for p in rho] == [49, 44, 40, 35, 31, 26, 21]
    assert C.model_config_for(cfg, "350m", "moe").moe_experts == 8    # the moe variant itself is unchanged
    slots = [p["dse_slots"] for p in S.slots_points(S.spec(cfg))]
    assert 2.5e5 < slots[0] < 2.7e5 and 0.99e7 < slots[-1] < 1.01e7
