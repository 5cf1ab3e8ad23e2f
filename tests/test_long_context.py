"""The DSE paper's long-context evaluation (its Table 2): LongPPL (stem.eval.longppl) against the longppl package's
definition, the RULER stand-in items (stem.eval.ruler_data) scored by lm-eval's own RULER code, the config's keys,
and the report's ``dse_long`` table with its direction rows."""
import copy
import inspect
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

pytest.importorskip("lm_eval")

from stem import config as C  # noqa: E402
from stem.checkpoint import save_checkpoint  # noqa: E402
from stem.data import synth  # noqa: E402
from stem.data.tokenizer import load_tokenizer, train_bpe  # noqa: E402
from stem.eval import fixtures, longppl, ruler_data, run  # noqa: E402
from stem.eval import spec as ES  # noqa: E402
from stem.models.spec import ModelConfig  # noqa: E402
from stem.models.model import build_model  # noqa: E402
from conftest import checked_yaml, reshaped  # noqa: E402

WORLD = {"seed": 3, "n_countries": 12, "n_people": 30, "n_filler": 300}
TINY = checked_yaml(C.REPO / "config" / "tiny.yaml")
TINY_EXP = C.experiment.parse(TINY, "tiny.yaml")   # its typed tree


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A small random dense model with a 256-token context, saved as an extend-stage checkpoint."""
    d = tmp_path_factory.mktemp("lc")
    w = synth.make_world(**WORLD)
    train_bpe([doc for doc, _ in zip(synth.web_documents(w), range(200))], 320, d / "tok.json")
    cfg = copy.deepcopy(TINY)
    cfg["archs"]["1b"].update(vocab_size=320, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=256)
    mc = C.model_config_for(reshaped(cfg), "1b", "dense").to_dict()
    torch.manual_seed(0)
    spec = {"experiment": "test", "scale": "1b", "variant": "dense", "stage": "extend", "model": mc}
    save_checkpoint(d / "checkpoint", build_model(ModelConfig.from_dict(mc), "cpu"), spec, d / "tok.json", {})
    return d / "checkpoint"


def package_lsd(model, ids: list[int], trunc_len: int, sliding_window: int):
    """(loss_short - loss_full, loss_full) per scored token, written as longppl 0.3.0's ``find_key_token`` loop is
    (its slicing and its shrinking last window), independently of stem.eval.longppl."""
    x = torch.tensor([ids])
    full = model(x)
    out_d, out_f = [], []
    max_len = x.shape[1]
    for start in range(0, max_len - trunc_len, sliding_window):
        if start + trunc_len + sliding_window > max_len:
            sliding_window = max_len - start - trunc_len
        short_ids = x[:, start:start + trunc_len + sliding_window]
        short = model(short_ids)
        lf = F.cross_entropy(full[0, start + trunc_len - 1:start + trunc_len + sliding_window - 1].float(),
                             x[0, start + trunc_len:start + trunc_len + sliding_window], reduction="none")
        ls = F.cross_entropy(short[0, trunc_len - 1:trunc_len + sliding_window - 1].float(),
                             short_ids[0, trunc_len:trunc_len + sliding_window], reduction="none")
        out_d.append(ls - lf)
        out_f.append(lf)
    return torch.cat(out_d), torch.cat(out_f)


@torch.no_grad()
def test_longppl_key_tokens_are_the_packages(ckpt, tmp_path):
    """Key tokens (LSD > alpha, LCL > beta) of our chunked short context equal the package's loop, token for
    token; the suite's LongPPL is exp of the evaluated model's mean NLL over exactly those tokens."""
    from stem.eval.lm import StemLM
    lm = StemLM(str(ckpt), device="cpu")
    w = synth.make_world(**WORLD)
    docs = [d for d, _ in zip(synth.long_documents(w, 0, 1500, 3000), range(2))]
    ids = [x[:256] for x in lm.tok.encode_batch(docs)]
    assert all(len(x) == 256 for x in ids)
    short, window = 48, 40   # 256 - 48 is no multiple of 40: the last window shrinks, as in the package
    nll, keys = [], []
    for k, x in enumerate(ids):
        lsd, lf = package_lsd(lm.model, x, short, window)
        long_nll = longppl.token_nll(lm.model, x, "cpu")
        ours_short = longppl.short_nll(lm.model, x, short, window, "cpu")
        assert torch.allclose(ours_short - long_nll[short - 1:], lsd, atol=1e-5)
        for alpha, beta in ((0.0, -5.5), (2.0, -2.0), (-0.05, -6.0)):
            want = torch.nonzero((lsd > alpha) & (lf < -beta)).flatten() + short - 1
            assert torch.equal(longppl.key_tokens(long_nll, ours_short, short, alpha, beta), want)
        nll.append(long_nll)
        keys.append(want + k * 255)   # the last thresholds', in the documents' concatenated NLL
    nll, keys = torch.cat(nll), torch.cat(keys)
    corpus = tmp_path / "long.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    spec = {"suite": "longppl", "kind": "longppl", "batch_size": 4, "seed": 0, "evaluator": "self", "documents": 2,
            "short": short, "window": window, "alpha": -0.05, "beta": -6.0, "categories": {"book": "long"},
            "category_documents": {"book": {"kind": "files", "paths": [str(corpus)], "format": "jsonl"}}}
    out = run.evaluate(ckpt, spec, tmp_path / "lp.json", tmp_path / "raw.json", lm=lm)
    entry = json.loads((tmp_path / "lp.json").read_text())["tasks"]["longppl_book"]
    assert entry["all_metrics"]["key_tokens"] == len(keys) > 0 and entry["n"] == 2
    assert entry["value"] == pytest.approx(math.exp(float(nll[keys].mean())), rel=1e-5)
    assert out["provenance"]["data"]["documents"].keys() == {str(corpus)}


@pytest.fixture(scope="module")
def ruler_fx(ckpt):
    """The 13 RULER stand-in tasks and their group, one 1,024-token item a task, sized with ckpt's tokenizer."""
    tasks = list(ruler_data.TASKS)
    spec = {"world": WORLD, "seed": 0, "items": 1, "train_items": 1, "tasks": tasks, "groups": {"ruler": tasks},
            "ruler": {"tokenizer": str(ckpt / "tokenizer.json"), "lengths": [1024], "max_gen_toks": 16}}
    fixtures.write_fixtures(spec, ckpt.parent / "fx")
    return ckpt.parent / "fx"


def test_ruler_stand_in_items_fit_and_score_with_lm_evals_code(ckpt, ruler_fx, tmp_path):
    """Every item of the 13 tasks fits its length with the tokenizer it was sized with, holds its answers, and
    lm-eval's RULER scoring gives a perfect answer 1 and an empty one 0."""
    from lm_eval.tasks.ruler.common_utils import process_results, process_results_part
    tok_path = ckpt / "tokenizer.json"
    tasks = list(ruler_data.TASKS)
    tok = load_tokenizer(tok_path)
    for task in tasks:
        (doc,) = [json.loads(x) for x in (ruler_fx / task / "test.jsonl").read_text().splitlines()]
        n = len(tok.encode_batch([f"{doc['input']}\n{doc['gen_prefix']}"])[0])
        assert n + 16 == doc["length"] <= doc["max_length"] == 1024, task
        assert doc["outputs"] and all(isinstance(o, str) and o for o in doc["outputs"]), task
        if task != "ruler_fwe":   # FWE's answers are its most frequent coded words, checked below
            assert all(o in doc["input"] for o in doc["outputs"]), task
        score = process_results_part if task.startswith("ruler_qa") else process_results
        assert score(doc, [" ".join(doc["outputs"])])["1024"] == 1.0
        assert score(doc, [""])["1024"] == 0.0
    fwe = json.loads((ruler_fx / "ruler_fwe" / "test.jsonl").read_text())
    words = fwe["input"].split("Find the three most frequently appeared coded words. ")[1].split("\n")[0].split()
    top = sorted({x for x in words if x != "..."}, key=words.count, reverse=True)[:3]
    assert sorted(top) == sorted(fwe["outputs"])
    # the paper path: lm-eval's own generators size RULER's items with the checkpoint's tokenizer, written for them
    # as a transformers folder (stem.eval.harness); it counts as the checkpoint's tokenizer does
    from lm_eval.tasks.ruler.common_utils import get_tokenizer
    from stem.hf.tokenizer import save_tokenizer
    save_tokenizer(tok_path, tok.eos_token, 256, tmp_path / "hf_tok")
    text = json.loads((ruler_fx / "niah_single_2" / "test.jsonl").read_text())["input"]
    assert get_tokenizer(str(tmp_path / "hf_tok"))(text).input_ids == tok.encode_batch([text])[0]


def as_read(value):
    """A loaded task config's value as lm-eval reads its YAML with ``resolve_func=False``: a function as
    ``<its module's file without .py>.<name>``."""
    if callable(value):
        return f"{Path(inspect.getfile(value)).resolve().with_suffix('')}.{value.__name__}"
    if isinstance(value, dict):
        return {k: as_read(v) for k, v in value.items()}
    return [as_read(v) for v in value] if isinstance(value, list) else value


def test_ruler_stand_in_is_lm_evals_task_on_its_own_data(ruler_fx):
    """Issue 43 item 9: each stand-in task, as lm-eval loads it, is lm-eval's installed RULER task (with its
    includes) key for key, the same prompt fields, generation settings and functions, but for its data
    (``custom_dataset`` dropped: lm-eval imports it on reading the YAML, docs/evaluation.md) and lm-eval's metric
    list extended by the stand-in's length; the group includes lm-eval's, aggregated at that length. On the same
    items, per-item scores and the task and group aggregates are those of lm-eval's own RULER functions."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml
    from lm_eval.tasks.ruler import common_utils as lm_ruler
    loaded = TaskManager(include_path=str(ruler_fx), include_defaults=False).load(["ruler"])
    tasks, group = loaded["tasks"], loaded["groups"]["ruler"]
    assert sorted(tasks) == sorted(ruler_data.TASKS)
    for name, task in tasks.items():
        real = load_yaml(fixtures.real_yaml(name), resolve_func=False)
        ours = load_yaml(ruler_fx / f"{name}.yaml", resolve_func=False)
        assert set(ours) == set(real) - {"custom_dataset"} | {"dataset_kwargs"}, name
        assert {k: ours[k] for k in ("tag", "metadata")} == {k: real[k] for k in ("tag", "metadata")}
        for key in set(real) - {"custom_dataset", "dataset_path", "dataset_name", "tag", "metadata"}:
            want = real[key] + [{**real[key][0], "metric": "1024"}] if key == "metric_list" else real[key]
            assert as_read(getattr(task.config, key)) == want, (name, key)
        assert task.config.custom_dataset is None and task.config.dataset_path == "json"
    real_group = yaml.safe_load(fixtures.real_yaml("ruler").read_text())
    assert yaml.safe_load((ruler_fx / "_ruler.yaml").read_text())["include"] == str(fixtures.real_yaml("ruler"))
    assert [(a.metric, a.weight_by_size) for a in group.aggregate_metric_list] == [
        ("1024", e["weight_by_size"]) for e in real_group["aggregate_metric_list"]]
    scores, metrics = {}, {}
    for i, (name, task) in enumerate(sorted(tasks.items())):
        real_fn = getattr(lm_ruler, load_yaml(fixtures.real_yaml(name), resolve_func=False)["process_results"]
                          .rsplit(".", 1)[1])
        (doc,) = task.test_docs()
        outs = list(doc["outputs"])
        preds = [" ".join(outs), "", outs[0], " ".join(outs).upper(), f"no {outs[-1][::-1]}"][:1 + i % 5]
        got = [task.process_results(doc, [p]) for p in preds]
        assert got == [real_fn(doc, [p]) for p in preds], name
        assert got[0] == {"4096": -1.0, "1024": 1.0} and all(g["1024"] == 0.0 for g in got[1:2]), name
        scores[name] = [g["1024"] for g in got]
        agg = task.aggregation()["1024"](scores[name])
        assert agg == lm_ruler.aggregate_metrics(scores[name]) == sum(scores[name]) / len(preds), name
        assert task.aggregation()["4096"]([g["4096"] for g in got]) == -1   # lm-eval's: no item of that length
        metrics[name] = {"1024,none": agg, "sample_len": len(preds)}
    assert {round(x, 2) for x in scores["niah_multiquery"] + scores["ruler_cwe"]} > {0.0, 1.0}   # partial credit
    want = sum(m["1024,none"] for m in metrics.values()) / len(metrics)   # lm-eval's ruler: unweighted
    assert group.aggregate(metrics)["1024,none"] == pytest.approx(want, abs=1e-12)


def test_long_context_suites_run_for_dense_and_dse_only():
    targets = [t for t in ES.eval_targets(TINY_EXP) if t.endswith(("/longppl.json", "/ruler.json"))]
    assert sorted(targets) == sorted(f"results/tiny/1b/{v}/extend/eval/{s}.json"
                                     for v in ("dense", "dse") for s in ("longppl", "ruler"))
    inputs = ES.rule_inputs(TINY_EXP, "tiny", "1b", "dse", "extend", "longppl")
    assert inputs["evaluator"] == "results/tiny/1b/dense/extend/checkpoint"   # key tokens: the dense model's
    assert "evaluator" not in ES.rule_inputs(TINY_EXP, "tiny", "1b", "dense", "extend", "longppl")
    assert ES.fixture_inputs(TINY_EXP) == {"tokenizer": "data/tiny/1b/tokenizer/tokenizer.json"}
    paper = C.experiment.load(C.REPO / "config" / "paper.yaml")   # lm-eval's RULER at 32k, no fixtures
    spec = ES.job_spec(paper, "paper", "1b", "dense", "extend", "ruler")
    assert spec["tasks"] == ["ruler"] and spec["fixtures"] is None and spec["truncation"] == "error"
    assert spec["metadata"] == {"max_seq_lengths": [32768]} and spec["metric"] == ["32768,none"]


def test_longppl_evaluator_defaults_to_the_baseline_variant():
    """Without ``evaluator:`` the key tokens are the baseline's (config/variants.yaml's ``baseline: true``, here moved
    to dse by variant_overrides), not a variant named in the code."""
    cfg = C.deep_merge(copy.deepcopy(TINY), {"variant_overrides": {"dense": {"baseline": False},
                                                                   "dse": {"baseline": True}}})
    del cfg["eval"]["suites"]["longppl"]["evaluator"]
    exp = C.experiment.parse(cfg, "tiny.yaml (dse the baseline, no evaluator)")
    assert ES.suite_spec(exp, "longppl")["evaluator"] == C.baseline_variant(exp) == "dse"
    assert ES.rule_inputs(exp, "tiny", "1b", "dense", "extend", "longppl")["evaluator"] == \
        "results/tiny/1b/dse/extend/checkpoint"
    assert "evaluator" not in ES.rule_inputs(exp, "tiny", "1b", "dse", "extend", "longppl")


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["eval"]["suites"]["ruler"].update(variants=["nope"]),
     r"key 'eval.suites.ruler.variants': \['nope'\]; expected a non-empty list of variants"),
    (lambda c: c["eval"]["suites"]["longppl"].update(categories={"book": "nowhere"}),
     r"key 'eval.suites.longppl.categories': unknown source 'nowhere'"),
    (lambda c: c["eval"]["suites"]["longppl"].update(short=0), r"key 'eval.suites.longppl.short': 0; expected an integer"),
    (lambda c: c["eval"]["suites"]["longppl"].update(evaluator="gpt"), r"key 'eval.suites.longppl.evaluator': 'gpt'"),
    (lambda c: c["eval"]["suites"]["ruler"].update(metadata=32768), r"key 'eval.suites.ruler.metadata': 32768"),
    (lambda c: c["eval"]["fixtures"]["ruler"].update(scale="7b"), r"key 'eval.fixtures.ruler.scale': '7b'"),
    (lambda c: c["eval"]["fixtures"]["ruler"].update(lengths=[]), r"key 'eval.fixtures.ruler.lengths': \[\]"),
])
def test_long_context_config_errors_are_one_line(edit, message):
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    edit(cfg)
    with pytest.raises(C.ConfigError, match=r"^config: " + message):
        C.experiment.parse(cfg)


def test_dse_long_table_and_its_directions(tmp_path):
    """Categories are the means of their tasks; LongPPL is lower-better; the direction rows compare our DSE - dense
    with the paper's DSE-27B (50k) - MoE-27B (50k)."""
    from stem.report import diff as D
    from stem.report import tables as T
    from stem.report.results import Results
    ruler = {"niah_single_1": 10.0, "niah_single_2": 20.0, "niah_single_3": 30.0, "niah_multikey_1": 0.0,
             "niah_multikey_2": 0.0, "niah_multikey_3": 0.0, "niah_multivalue": 5.0, "niah_multiquery": 5.0,
             "ruler_vt": 1.0, "ruler_cwe": 2.0, "ruler_fwe": 3.0, "ruler_qa_squad": 40.0, "ruler_qa_hotpot": 60.0}
    for v, ppl, bump in (("dense", 8.0, 0.0), ("dse", 6.0, 1.0)):
        d = tmp_path / "tiny" / "1b" / v / "extend" / "eval"
        d.mkdir(parents=True)
        job = {"experiment": "tiny", "scale": "1b", "variant": v, "stage": "extend"}
        (d / "longppl.json").write_text(json.dumps({**job, "suite": "longppl",
                                                    "tasks": {"longppl_book": {"value": ppl}}}))
        (d / "ruler.json").write_text(json.dumps({**job, "suite": "ruler",
                                                  "tasks": {t: {"value": x + bump} for t, x in ruler.items()}}))
    tiny = C.experiment.parse(TINY)
    df = T.dse_long_table(tiny, Results("tiny", tmp_path)).set_index(["variant", "column"])["value"]
    assert df["dense", "ruler_s"] == pytest.approx(20.0) and df["dense", "ruler_qa"] == pytest.approx(50.0)
    assert df["dse", "longppl_book"] == 6.0 and math.isnan(df["dse", "longppl_code"])
    dirs = D.point_directions({"dse_long": T.dse_long_table(tiny, Results("tiny", tmp_path))}, "dense").set_index("column")
    assert dirs.loc["longppl_book", "paper_delta"] == pytest.approx(4.14 - 4.38)   # DSE-27B (50k) - MoE-27B (50k)
    assert dirs.loc["longppl_book", "ours"] == "beats baseline" and dirs.loc["longppl_book", "agree"]
    assert dirs.loc["ruler_s", "paper_says"] == "trails baseline" and not dirs.loc["ruler_s", "agree"]
    assert dirs.loc["longppl_code", "ours"] == "missing"


def test_ruler_items_are_sized_only_when_a_fixture_task_is_rulers():
    """The eval_fixtures job waits for the tokenizer only when it generates RULER items (the reduced DAG of
    tests/test_workflow.py keeps the `ruler` section with other tasks)."""
    cfg = copy.deepcopy(TINY)
    cfg["eval"]["fixtures"]["tasks"] = ["arc_easy"]
    cfg = C.experiment.parse(cfg, "tiny.yaml (fixtures: arc_easy)")
    assert ES.fixture_inputs(cfg) == {} and "tokenizer" not in (ES.fixture_spec(cfg).get("ruler") or {})
    assert all(t.startswith(ES.RULER_TASK_PREFIXES) for t in ruler_data.TASKS)


def test_ruler_items_do_not_depend_on_pythons_hash_seed():
    """The variable-tracking item once drew its names into a set: its order (and the fixture's bytes) changed with
    PYTHONHASHSEED from one run to the next."""
    code = ("import json, random; from stem.data import synth; from stem.eval import ruler_data as R; "
            "w = synth.make_world(seed=3, n_countries=8, n_people=20, n_filler=100); "
            "build, _ = R._vt(random.Random(5), w, 'ruler_vt', 1024); print(json.dumps(build(6)))")
    outs = {subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONHASHSEED": seed}, cwd=C.REPO,
                           capture_output=True, text=True, check=True).stdout for seed in ("1", "2", "3")}
    assert len(outs) == 1, outs
