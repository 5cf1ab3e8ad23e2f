"""The evaluation stage: the lm-eval adapter, decoding, fixtures end to end, output format, errors."""
import json
import shutil

import pytest
import torch

pytest.importorskip("lm_eval")

from stem.data.tokenizer import train_bpe  # noqa: E402
from stem.eval import fixtures, harness, run  # noqa: E402
from stem.eval import spec as ES  # noqa: E402
from stem.eval.generate import greedy_generate  # noqa: E402
from stem.eval.lm import StemLM, cut_at_stop  # noqa: E402
from stem.models.spec import ModelConfig  # noqa: E402
from stem.models.model import build_model  # noqa: E402
from stem.checkpoint import save_checkpoint  # noqa: E402
from conftest import reshaped  # noqa: E402

WORLD = {"seed": 3, "n_countries": 8, "n_people": 20, "n_filler": 100}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A small random STEM model saved as a training-stage checkpoint."""
    from stem.data import synth
    d = tmp_path_factory.mktemp("ckpt")
    w = synth.make_world(**WORLD)
    docs = [doc for doc, _ in zip(synth.web_documents(w), range(200))]
    train_bpe(docs, 320, d / "tok.json")
    from stem import config as C
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["archs"]["1b"].update(vocab_size=320, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=256)
    mc = C.model_config_for(reshaped(cfg), "1b", "stem").to_dict()
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(mc), "cpu")
    spec = {"experiment": "test", "scale": "1b", "variant": "stem", "stage": "pretrain", "model": mc}
    save_checkpoint(d / "checkpoint", model, spec, d / "tok.json", {})
    return d / "checkpoint"


@pytest.fixture(scope="module")
def lm(ckpt):
    return StemLM(str(ckpt), device="cpu", batch_size=4)


class Req:  # the part of lm_eval's Instance the adapter reads
    def __init__(self, *args):
        self.args = args


@torch.no_grad()
def direct_loglikelihood(lm, ctx, cont):
    c, x = lm._encode_pair(ctx, cont)
    ids = torch.tensor([c + x])
    logp = torch.log_softmax(lm.model(ids)[0].float(), -1)
    return sum(float(logp[len(c) - 1 + i, t]) for i, t in enumerate(x))


PAIRS = [("The capital of Sarland is", " Bondo."), ("Question: what?\nAnswer:", " yes"),
         ("a b c d e f g h i j", " k l m n o p"), ("x", " y"), ("One two three four five six seven", " eight")]


def test_loglikelihood_matches_direct_computation(lm):
    got = lm.loglikelihood([Req(c, x) for c, x in PAIRS])
    for (c, x), (lp, greedy) in zip(PAIRS, got):
        assert lp == pytest.approx(direct_loglikelihood(lm, c, x), abs=1e-4)
        assert isinstance(greedy, bool)


def test_loglikelihood_batch_size_invariant(lm):
    reqs = [Req(c, x) for c, x in PAIRS * 3]
    results = []
    for bs in (1, 3, 16):
        lm.batch_size = bs
        results.append([lp for lp, _ in lm.loglikelihood(reqs)])
    lm.batch_size = 4
    for other in results[1:]:
        assert other == pytest.approx(results[0], abs=1e-4)


def test_loglikelihood_left_truncates_long_context(lm):
    long_ctx = "word " * 800
    (lp, _), = lm.loglikelihood([Req(long_ctx, " end")])
    assert lp < 0 and lp == lp  # finite, no error past max_seq_len


def test_rolling_loglikelihood_sums_windows(lm):
    text = "The capital of Sarland is Bondo. " * 60  # longer than the context: several windows
    (total,) = lm.loglikelihood_rolling([Req(text)])
    ids = lm.tok_encode(text)
    assert len(ids) > lm.max_length and total < 0


def test_kv_cache_generation_equals_uncached(lm):
    ids = lm.tok_encode("The capital of Sarland is")
    a = greedy_generate(lm.model, ids, 40, eos_id=None, use_cache=True)
    b = greedy_generate(lm.model, ids, 40, eos_id=None, use_cache=False)
    assert a == b and len(a) == 40


def test_batched_generation_equals_one_at_a_time(lm):
    from stem.eval.generate import greedy_generate_batch
    prompts = [lm.tok_encode(t) for t in ("The capital of", "a b c d e f g h i j k l", "x")]
    single = [greedy_generate(lm.model, p, 20, eos_id=None) for p in prompts]
    assert greedy_generate_batch(lm.model, prompts, 20, eos_id=None) == single


def test_generation_stops_at_eos(lm):
    ids = lm.tok_encode("hello")
    first = greedy_generate(lm.model, ids, 5, eos_id=None)[0]
    assert greedy_generate(lm.model, ids, 5, eos_id=first) == []


def test_stop_strings_cut_correctly(lm):
    assert cut_at_stop("abc\n\nQuestion: x", ["Question:", "\n\n"]) == "abc"
    assert cut_at_stop("no stop here", ["Q:"]) == "no stop here"
    full = lm.generate("The capital of", [], 30)
    stop = full[5:8]
    out = lm.generate_until([Req("The capital of", {"until": [stop], "max_gen_toks": 30})])[0]
    assert out == full.split(stop, 1)[0] and stop not in out
    assert len(greedy_generate(lm.model, lm.tok_encode("The capital of"), 3)) == 3  # max_gen_toks


def _tiny_cfg(tmp_path):
    from stem import config as C
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["world"] = WORLD
    return C.experiment.parse(cfg, "tiny.yaml (the test's world)")


def test_fixture_task_runs_through_simple_evaluate(lm, tmp_path):
    cfg = _tiny_cfg(tmp_path)
    fx = {**cfg.eval["fixtures"], "world": WORLD, "seed": 0, "items": 6, "train_items": 3,
          "tasks": ["arc_easy", "boolq", "gsm8k", "longbench_hotpotqa", "longbench_lcc"],
          "groups": {"longbench_multi": ["longbench_hotpotqa"], "longbench_code": ["longbench_lcc"],
                     "longbench": ["longbench_multi", "longbench_code"]}}
    fixtures.write_fixtures(fx, tmp_path / "fx")
    assert "include:" in (tmp_path / "fx" / "arc_easy.yaml").read_text()
    spec = ES.suite_spec(cfg, "commonsense")
    spec.update(tasks=["arc_easy", "boolq"], fixtures=str(tmp_path / "fx"))
    out = run.evaluate(lm.pretrained, spec, tmp_path / "cs.json", tmp_path / "raw.json", lm=lm)
    saved = json.loads((tmp_path / "cs.json").read_text())
    assert saved["tasks"].keys() == {"arc_easy", "boolq"} == out["tasks"].keys()
    for t in saved["tasks"].values():
        assert 0 <= t["value"] <= 100 and t["n"] == 6 and t["version"] is not None and t["stderr"] is not None
    assert saved["tasks"]["arc_easy"]["metric"] == "acc_norm,none"
    assert "samples" in json.loads((tmp_path / "raw.json").read_text())
    cut = saved["truncation"]   # per task: requests (one per answer choice), none cut in the 256-token context
    assert cut["policy"] == "left" and cut["context"] == 256 and cut["tasks"].keys() == {"arc_easy", "boolq"}
    rt = saved["runtime"]   # issue 39: what the numbers were computed with, recorded
    assert rt["device"] == str(lm._device) and rt["dtype"] == "float32" and rt["threads"] == torch.get_num_threads()
    assert rt["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and "deterministic" in rt
    assert cut["tasks"]["boolq"] == {"requests": 12, "truncated": 0, "tokens_dropped": 0}
    # generation task + per-length buckets
    spec = ES.suite_spec(cfg, "longbench")
    spec["fixtures"] = str(tmp_path / "fx")
    out = run.evaluate(lm.pretrained, spec, lm=lm, limit=4)
    cut = out["truncation"]   # LongBench's protocol: its fixture's long contexts cut in the middle, and counted
    assert cut["policy"] == "middle" and cut["tasks"].keys() == {"longbench_hotpotqa", "longbench_lcc"}
    assert all(t["requests"] == 4 and t["truncated"] >= 1 and t["tokens_dropped"] > 0 for t in cut["tasks"].values())
    assert {"longbench", "longbench_multi", "longbench_code"} <= out["groups"].keys()
    rows = out["by_length"]["table6"]
    assert [r["range"] for r in rows][-1] == "600+"
    assert sum(sum(r["n"].values()) for r in rows) == 8


def test_gsm8k_fixture_schema(tmp_path):
    fixtures.write_fixtures({"world": WORLD, "seed": 0, "items": 5, "train_items": 2, "tasks": ["gsm8k"]}, tmp_path)
    docs = [json.loads(x) for x in (tmp_path / "gsm8k" / "test.jsonl").read_text().splitlines()]
    assert len(docs) == 5 and all(d["answer"].rsplit("#### ", 1)[1].lstrip("-").isdigit() for d in docs)


def test_niah_cells(lm, tmp_path):
    from stem.eval import niah
    from stem.data import synth
    docs = [d for d, _ in zip(synth.long_documents(synth.make_world(**WORLD), 0, 500, 1500), range(5))]
    with pytest.raises(ValueError, match="no room"):
        niah.make_items(lm.tok, docs, [16], [0], 1)
    items = niah.make_items(lm.tok, docs, [224, 256], [0, 50, 100], 2, max_gen_toks=4)
    assert all(len(lm.tok_encode(it["prompt"])) + 4 <= it["length"] for it in items)
    res = niah.run(lm, items, 4)
    assert [(c["length"], c["depth"]) for c in res["cells"]] == [(L, d) for L in (224, 256) for d in (0, 50, 100)]
    with pytest.raises(ValueError, match="exceeds the cell"):
        niah.run(lm, items, 12)  # a larger generation budget than the items were made for


def test_niah_depth_unit_follows_the_protocol(lm):
    """Issue 43 item 7: a fixed needle (the original test, Kamradt) sits at depth % of the haystack's tokens, moved
    back to the previous sentence end: at most the depth's share of tokens precede it, and the next sentence would
    pass it; RULER's key/value needles keep the share of sentences."""
    from stem.eval import niah
    from stem.data import synth
    docs = [d for d, _ in zip(synth.long_documents(synth.make_world(**WORLD), 0, 500, 1500), range(5))]
    n = lambda text: len(lm.tok_encode(text))  # noqa: E731
    for depth in (25, 50, 75):
        it, = niah.make_items(lm.tok, docs, [512], [depth], 1, max_gen_toks=4, needle="original")
        assert it["placement"] == niah.TOKENS
        at = it["prompt"].index(niah.ORIGINAL["text"])
        before = it["prompt"][:at].strip()
        after = it["prompt"][at + len(niah.ORIGINAL["text"]):it["prompt"].rindex("\n\n")].strip()
        hay, target = n(before) + n(after), (n(before) + n(after)) * depth / 100
        nxt = after.split(". ")[0] + "."
        assert n(before) <= target + 2 < n(before) + n(" " + nxt) + 2, (depth, n(before), target)
    it, = niah.make_items(lm.tok, docs, [512], [50], 1, max_gen_toks=4)
    assert it["placement"] == niah.SENTENCES and niah.insertion_point([1, 1, 1, 10], 50, niah.SENTENCES) == 2
    assert niah.insertion_point([1, 1, 1, 10], 50, niah.TOKENS) == 3 and niah.insertion_point([13], 100, "tokens") == 1


class NeedleOracle(torch.nn.Module):
    """A stand-in model that answers NIAH perfectly from the ids it is given, no more: it decodes them and,
    if the whole needle of the queried key is among them, emits its value digit by digit and a newline;
    otherwise EOS. Stateless (no KV cache): each decoding step sees prompt + generated tokens."""
    supports_kv_cache = False

    def __init__(self, tok, context: int):
        super().__init__()
        from types import SimpleNamespace
        self.tok, self.w = tok, torch.nn.Parameter(torch.zeros(1))
        self.cfg = SimpleNamespace(max_seq_len=context, vocab_size=tok.vocab_size)
        self.longest, self.prompts = 0, set()  # longest input; the inputs of first decoding steps

    def forward(self, x, cache=None, **kw):
        import re
        assert cache is None and x.shape[0] == 1
        self.longest = max(self.longest, x.shape[1])
        text = self.tok.decode(x[0].tolist())
        nxt = self.tok.eos_id
        q = list(re.finditer(r"The special magic number for (\w+) mentioned in the provided text is", text))
        if q:
            needle = re.search(rf"One of the special magic numbers for {q[-1][1]} is: (\d+)\.", text[:q[-1].start()])
            target, gen = (needle[1] + "\n" if needle else ""), text[q[-1].end():]
            if not gen:
                self.prompts.add(tuple(x[0].tolist()))
            if target.startswith(gen) and len(gen) < len(target):
                (nxt,) = self.tok.encode_batch([target[len(gen)]])[0]
        logits = torch.zeros(1, 1, self.cfg.vocab_size)  # the decoder reads the last position only
        logits[0, -1, nxt] = 1.0
        return logits


@pytest.mark.parametrize("experiment", ["tiny", "paper"])
def test_niah_oracle_scores_100_in_every_cell(ckpt, tmp_path, experiment):
    """Through run.evaluate (items, decoding with the decoder's left truncation, scoring) with a model
    whose context is exactly the cell length: prompt plus generation fit, so the needle is never cut."""
    from stem import config as C
    from stem.data import synth
    cfg = C.experiment.load(C.REPO / "config" / f"{experiment}.yaml")
    spec = ES.suite_spec(cfg, "niah")
    w = synth.make_world(**WORLD)
    n_docs = 8 if experiment == "tiny" else 60
    docs = tmp_path / "long.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d, _ in zip(synth.long_documents(w, 0, 4000, 16000),
                                                                             range(n_docs))))
    spec["documents"] = {"kind": "files", "paths": [str(docs)], "format": "jsonl"}
    lm = StemLM(str(ckpt), device="cpu", batch_size=4)
    lm.use_cache = False
    cells = []
    for length in spec["lengths"]:
        lm.model, lm._max_length = NeedleOracle(lm.tok, length), length
        raw = tmp_path / f"raw{length}.json"
        out = run.evaluate(ckpt, {**spec, "lengths": [length]}, raw_json=raw, lm=lm,
                           limit=1 if experiment == "paper" else None)
        assert lm.model.longest <= length
        assert out["truncation"]["policy"] == "error" and out["truncation"]["tasks"]["niah"]["truncated"] == 0
        items = json.loads(raw.read_text())["items"]
        assert len(items) == len(spec["depths"]) * (1 if experiment == "paper" else spec["samples"])
        assert all(tuple(lm.tok_encode(it["prompt"])) in lm.model.prompts for it in items)  # seen whole
        cells += out["cells"]
    assert [(c["length"], c["depth"]) for c in cells] == [(L, d) for L in spec["lengths"] for d in spec["depths"]]
    assert all(c["accuracy"] == 100.0 for c in cells), [c for c in cells if c["accuracy"] < 100]


def test_by_length_buckets():
    raw = {"group_subtasks": {"g": ["a", "b"]},
           "samples": {"a": [{"doc": {"length": 10}, "score": 1.0}, {"doc": {"length": 50}, "score": 0.0}],
                       "b": [{"doc": {"length": 15}, "score": 0.5}]}}
    out = harness.by_length(raw, {"t": [[0, 20], [20, None]]})
    lo, hi = out["t"]
    assert lo["groups"]["g"] == pytest.approx(75.0) and hi["groups"]["g"] == pytest.approx(0.0)
    assert hi["tasks"] == {"a": 0.0} and hi["range"] == "20+"


# ---- errors ------------------------------------------------------------------------------------------------
def test_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no such folder"):
        StemLM(str(tmp_path / "nope"))


def test_checkpoint_without_tokenizer_is_a_clear_error(ckpt, tmp_path):
    bad = tmp_path / "ckpt"
    shutil.copytree(ckpt, bad)
    (bad / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json is missing"):
        StemLM(str(bad))


def test_unknown_suite_and_task_are_clear_errors(lm, tmp_path):
    cfg = _tiny_cfg(tmp_path)
    with pytest.raises(ValueError, match="suite 'nope'"):
        ES.suite_spec(cfg, "nope")
    with pytest.raises(ValueError, match="no fixture generator|no lm-eval task"):
        fixtures.write_fixtures({"world": WORLD, "seed": 0, "items": 2, "train_items": 1, "tasks": ["nope"]}, tmp_path)
    fixtures.write_fixtures({"world": WORLD, "seed": 0, "items": 2, "train_items": 1, "tasks": ["boolq"]}, tmp_path / "fx")
    spec = ES.suite_spec(cfg, "commonsense")
    spec.update(tasks=["boolq", "not_a_task"], fixtures=str(tmp_path / "fx"))
    with pytest.raises(ValueError, match="unknown task"):
        run.evaluate(lm.pretrained, spec, lm=lm)


def test_cli_reports_errors(tmp_path, capsys):
    from stem.__main__ import main
    with pytest.raises(SystemExit):
        main(["eval", "--checkpoint", str(tmp_path / "nope"), "--suite", "commonsense"])
    assert "error:" in capsys.readouterr().err


def test_tiny_dag_ends_in_eval_jsons():
    from stem import config as C
    cfg = C.experiment.load(C.REPO / "config" / "tiny.yaml")
    targets = ES.eval_targets(cfg)
    assert "results/tiny/350m/stem/pretrain/eval/commonsense.json" in targets
    assert "results/tiny/1b/dense/extend/eval/longbench.json" in targets
    assert "results/tiny/1b/dse/extend/eval/longbench.json" in targets
    # 9 350m (stem_sparse, dse too) + 3 1b pretrain (dense, stem, dse); 4 midtrain x 3 suites; 4 extend x 4
    # (stem_insert from midtrain on) and LongPPL + RULER for dense and DSE; seeds 1 and 2 of 350m dense and STEM
    assert len(targets) == 9 + 3 + 4 * 3 + 4 * 4 + 2 * 2 + 4
    snakefile = (C.REPO / "Snakefile").read_text()
    assert 'include: "rules/eval.smk"' in snakefile and "eval_outputs()" in snakefile


# ---- lm-eval's own command line (stem-lm-eval) ------------------------------------------------------------
def test_lm_eval_cli_runs_the_stem_model(ckpt, lm, tmp_path):
    """The console command `stem-lm-eval` (pyproject [project.scripts]) is lm-eval's CLI with every flag
    unchanged; run it as a subprocess with lm-eval's default device (cuda:0) on a machine without CUDA
    for the process, and compare its scores with an in-process evaluation of the same items."""
    import os
    import subprocess
    import sys
    import tomllib

    from stem import config as C
    scripts = tomllib.loads((C.REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["stem-lm-eval"] == "stem.eval.lm_eval_cli:main"
    fixtures.write_fixtures({"world": WORLD, "seed": 0, "items": 4, "train_items": 2, "tasks": ["arc_easy"]},
                            tmp_path / "fx")
    cmd = [sys.executable, "-m", "stem.eval.lm_eval_cli", "--model", "stem", "--model_args", f"pretrained={ckpt}",
           "--tasks", "arc_easy", "--include_path", str(tmp_path / "fx"), "--batch_size", "2",
           "--output_path", str(tmp_path / "out")]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(C.REPO), "HF_DATASETS_OFFLINE": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "requested but this machine has no CUDA; using cpu" in r.stderr
    assert "evaluating on device cpu" in r.stderr
    (res_file,) = (tmp_path / "out").rglob("results_*.json")
    got = json.loads(res_file.read_text())
    assert got["config"]["model"] == "stem" and got["n-samples"]["arc_easy"]["effective"] == 4
    spec = {**ES.suite_spec(_tiny_cfg(tmp_path), "commonsense"), "tasks": ["arc_easy"], "fixtures": str(tmp_path / "fx")}
    ref = harness.run_lm_eval(lm, spec)["results"]["arc_easy"]
    for k in ("acc,none", "acc_norm,none"):
        assert got["results"]["arc_easy"][k] == pytest.approx(ref[k])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_stem_eval_refuses_a_device_this_machine_lacks(ckpt, tmp_path, capsys):
    """Issue 39: ``python -m stem eval`` (and the workflow's eval job) with device cuda on a machine without
    CUDA refuses with one line, as training does, instead of evaluating on the CPU; nothing is written."""
    from stem.__main__ import main
    out = tmp_path / "out.json"
    with pytest.raises(SystemExit) as e:
        main(["eval", "--checkpoint", str(ckpt), "--suite", "ppl", "--device", "cuda", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 1 and len(err.splitlines()) == 1
    assert err.startswith("error: device 'cuda' requested but CUDA is not available on this machine")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_device_falls_back_to_the_one_that_exists(capsys):
    from stem.eval.lm import pick_device
    if torch.cuda.is_available():
        assert pick_device("cuda:0") == "cuda:0"
    else:
        assert pick_device("cuda:0") == "cpu" and "no CUDA; using cpu" in capsys.readouterr().err
    assert pick_device("cpu") == "cpu" and "evaluating on device cpu" in capsys.readouterr().err
    assert pick_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")


# ---- the eval stage reads the checkpoint its job is for (issue 16) -----------------------------------------
def _ppl_spec(tmp_path):
    from stem.data import synth
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d, _ in zip(synth.web_documents(synth.make_world(**WORLD)), range(2))))
    spec = ES.suite_spec(_tiny_cfg(tmp_path), "ppl")
    spec.update(documents={"kind": "files", "paths": [str(docs)], "format": "jsonl"}, device="cpu")
    return spec


def test_eval_refuses_a_checkpoint_of_another_job(ckpt, lm, tmp_path):
    spec = _ppl_spec(tmp_path)
    job = {"experiment": "test", "scale": "1b", "variant": "dense", "stage": "pretrain"}
    out = tmp_path / "out.json"
    with pytest.raises(ValueError, match=r"checkpoint .*config.json: saved job test/1b/stem/pretrain, but this eval "
                                         r"job .* is for test/1b/dense/pretrain \(variant 'stem' != 'dense'\)"):
        run.evaluate(ckpt, {**spec, "job": job}, out, lm=lm)
    assert not out.exists()
    # no job in the spec: the output path of the results layout says what the checkpoint must be
    out = tmp_path / "results" / "test" / "350m" / "stem" / "midtrain" / "eval" / "ppl.json"
    with pytest.raises(ValueError, match=r"scale '1b' != '350m', stage 'pretrain' != 'midtrain'"):
        run.evaluate(ckpt, spec, out, lm=lm)
    assert not out.parent.exists()
    out = tmp_path / "results" / "test" / "1b" / "stem" / "pretrain" / "eval" / "ppl.json"
    r = run.evaluate(ckpt, spec, out, lm=lm, limit=1)
    assert (r["experiment"], r["scale"], r["variant"], r["stage"]) == ("test", "1b", "stem", "pretrain") and out.is_file()
    assert ES.job_spec(_tiny_cfg(tmp_path), "tiny", "1b", "stem", "pretrain", "ppl")["job"] == {
        "experiment": "tiny", "scale": "1b", "variant": "stem", "stage": "pretrain"}
    from stem import config as C
    rule = (C.REPO / "rules" / "eval.smk").read_text()
    assert "EV.job_spec(EXPERIMENT, w.experiment, w.scale, w.variant, w.stage, w.suite)" in rule


def test_eval_job_script_errors_and_labels(ckpt, tmp_path, monkeypatch, capsys):
    import sys
    from workflow_scripts import eval_suite
    from workflow_scripts._entry import run as run_entry
    spec = _ppl_spec(tmp_path)

    def call(job, *extra):
        argv = ["eval_suite", "--spec", json.dumps({**spec, "job": job}), "--checkpoint", str(ckpt),
                "--out", str(tmp_path / "o" / "ppl.json"), "--raw", str(tmp_path / "o" / "raw.json"), *extra]
        monkeypatch.setattr(sys, "argv", argv)
        run_entry(eval_suite.main)

    good = {"experiment": "test", "scale": "1b", "variant": "stem", "stage": "pretrain"}
    with pytest.raises(SystemExit) as e:
        call({**good, "experiment": "tiny"})
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and err[-1].startswith("error: checkpoint ") and "experiment 'test' != 'tiny'" in err[-1]
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit) as e:
        call(good, "--limit", "0")
    assert e.value.code == 1 and capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: limit 0: expected a positive whole number of items per task (or no limit)")
    call(good)  # the suite's own count of documents (config `documents: 40`; 2 in the file)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("ppl: scores {'ppl': ") and line.endswith(" s") and "; wall time " in line
    saved = json.loads((tmp_path / "o" / "ppl.json").read_text())
    assert saved["tasks"]["ppl"]["n"] == 2 and saved["variant"] == "stem"


def test_cli_limit_must_be_positive(tmp_path, capsys):
    from stem.__main__ import main
    with pytest.raises(SystemExit):
        main(["eval", "--checkpoint", str(tmp_path / "nope"), "--suite", "commonsense", "--limit", "0"])
    assert capsys.readouterr().err.strip() == "error: limit 0: expected a positive whole number of items per task (or no limit)"


@pytest.mark.parametrize("variant", ["stem_half", "dse"])
def test_offloaded_tables_score_the_same_through_simple_evaluate(ckpt, lm, tmp_path, variant):
    """model_args offload=true,cache_rows=N (lm-eval's own parsing): same scores and responses, loglikelihood
    and generation, and the engine served the forwards (hits from its cache); STEM tables and DSE tables."""
    from lm_eval import simple_evaluate
    from lm_eval.api.registry import get_model

    from stem import config as C
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")  # the fixture's shapes; STEM-1/2 puts a table in layer 1
    cfg["archs"]["1b"].update(vocab_size=320, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=256)
    cfg["variant_overrides"]["dse"] = {"dse": {"rows_per_head": 61, "d_mem": 16, "heads": 2}}
    mc = C.model_config_for(reshaped(cfg), "1b", variant).to_dict()
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(mc), "cpu")
    if variant == "dse":   # the DSE layer(s): tables as large as activations, taps in the convolution
        mems = [b.dse for b in model.layers if b.dse is not None]
        tables = [t.weight for m in mems for t in m.tables]
        for m in mems:
            m.conv.weight.data.normal_(std=0.5)
    else:                  # STEM-1/2 puts a table in layer 1
        tables = [model.layers[1].ffn.table.weight]
    for w in tables:
        w.data.normal_()   # rows as large as activations: a wrong row changes scores
    spec = {"experiment": "test", "scale": "1b", "variant": variant, "stage": "pretrain", "model": mc}
    save_checkpoint(tmp_path / "ckpt", model, spec, ckpt / "tokenizer.json", {})
    ckpt = tmp_path / "ckpt"
    fixtures.write_fixtures({"world": WORLD, "seed": 0, "items": 4, "train_items": 2, "tasks": ["arc_easy", "gsm8k"]},
                            tmp_path / "fx")
    tm = harness.task_manager(str(tmp_path / "fx"))
    args = f"pretrained={ckpt},device=cpu,batch_size=4,max_gen_toks=6"
    off = get_model("stem").create_from_arg_string(args + ",offload=true,cache_rows=16")
    assert off.offload is not None and off.offload.stats()["cache_rows"] == 16
    outs = [simple_evaluate(model=m, tasks=["arc_easy", "gsm8k"], num_fewshot=0, task_manager=tm, log_samples=True,
                            bootstrap_iters=0, random_seed=0) for m in (get_model("stem").create_from_arg_string(args), off)]
    for task in ("arc_easy", "gsm8k"):
        assert outs[0]["results"][task] == outs[1]["results"][task]
        assert [s["resps"] for s in outs[0]["samples"][task]] == [s["resps"] for s in outs[1]["samples"][task]]
    s = off.offload.stats()
    assert s["forwards"] > 8 and s["hits" if variant == "stem_half" else "dse_hits"] > 0
    assert s["freed_bytes"] == sum(w.numel() for w in tables) * 4   # stem_half: the table of layer 1 (320 x 64)
    with pytest.raises(ValueError, match="cache_rows=4: a row cache needs offload=true"):
        StemLM(str(ckpt), device="cpu", cache_rows=4)
    with pytest.raises(ValueError, match="offload='maybe': expected true or false"):
        StemLM(str(ckpt), device="cpu", offload="maybe")


def test_the_workflows_eval_specs_import_neither_torch_nor_lm_eval():
    """rules/eval.smk builds every eval job's spec, inputs and targets from stem.eval.spec: the built-in runners
    are registered by name ("module:function"), so building the DAG imports neither torch nor lm-eval."""
    import subprocess
    import sys

    from stem import config as C
    code = ("import sys; from stem import config as C; from stem.eval import spec as EV\n"
            "cfg = C.experiment.load(C.REPO / 'config' / 'tiny.yaml')\n"
            "for p in EV.eval_targets(cfg)[:12]:\n"
            "    _, _, scale, variant, stage, _, suite = p[:-5].split('/')\n"
            "    EV.job_spec(cfg, 'tiny', scale, variant, stage, suite); EV.rule_inputs(cfg, 'tiny', scale, variant, stage, suite)\n"
            "assert EV.SUITE_KINDS['niah'].runner == 'stem.eval.niah:run_niah'\n"
            "print(sorted(m for m in ('torch', 'lm_eval') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], cwd=C.REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"
