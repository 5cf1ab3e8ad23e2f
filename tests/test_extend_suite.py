"""Extending the evaluation (docs/extending.md): a suite kind defined and registered from this file alone
runs through the config check, the workflow's spec and inputs, and the eval job's entry point. (Registered in
this process; tests/test_plugins.py loads a kind from a config's ``plugins:`` in a fresh process, as Snakemake.)"""
import json
import sys

import pytest
import torch

pytest.importorskip("lm_eval")

from stem import config as C  # noqa: E402
from stem.eval import run  # noqa: E402
from stem.eval import spec as ES  # noqa: E402
from conftest import reshaped  # noqa: E402

WORLD = {"seed": 3, "n_countries": 8, "n_people": 20, "n_filler": 100}
PAIRS = [["The capital of Sarland is", " Bondo."], ["One two three", " four five"], ["x", " y z"]]


# ---- the toy kind: mean log-probability of each pair's continuation given its context, pairs from a file ---
def _resolve(exp, spec: dict) -> None:  # completes the spec from the experiment config
    spec.setdefault("pairs_file", f"data/{exp.experiment}/toy_pairs.json")


def _inputs(exp, spec: dict) -> dict:  # the eval job's inputs besides the checkpoint
    return {"pairs": spec["pairs_file"]}


def continuation_logprob(lm, spec: dict, limit=None):
    from lm_eval.api.instance import Instance
    with open(spec["pairs_file"]) as f:
        pairs = json.load(f)[:limit]
    lps = [lp for lp, _ in lm.loglikelihood([Instance("loglikelihood", {}, tuple(p), i) for i, p in enumerate(pairs)])]
    mean = sum(lps) / len(lps)
    entry = {"metric": "mean_logprob", "value": mean, "stderr": None, "n": len(pairs), "version": "toy-1",
             "all_metrics": {"mean_logprob": mean}}
    return {"tasks": {"toy": entry}, "groups": {}}, {"logprobs": lps}, "tests.toy"


@pytest.fixture
def toy_kind():
    ES.suite_kind("continuation_logprob", resolve=_resolve, inputs=_inputs)(continuation_logprob)
    yield "continuation_logprob"
    ES.SUITE_KINDS.remove("continuation_logprob")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A small random STEM model saved as the checkpoint of job test/1b/stem/pretrain."""
    from stem.data import synth
    from stem.data.tokenizer import train_bpe
    from stem.models.spec import ModelConfig
    from stem.models.model import build_model
    from stem.checkpoint import save_checkpoint
    d = tmp_path_factory.mktemp("ckpt")
    train_bpe([doc for doc, _ in zip(synth.web_documents(synth.make_world(**WORLD)), range(200))], 320, d / "tok.json")
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["archs"]["1b"].update(vocab_size=320, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64, max_seq_len=256)
    mc = C.model_config_for(reshaped(cfg), "1b", "stem").to_dict()
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(mc), "cpu")
    save_checkpoint(d / "checkpoint", model, {"experiment": "test", "scale": "1b", "variant": "stem",
                                              "stage": "pretrain", "model": mc}, d / "tok.json", {})
    return d / "checkpoint"


def _cfg_with_toy_suite(**keys):
    cfg = C.read_yaml(C.REPO / "config" / "tiny.yaml")
    cfg["eval"]["suites"]["toy"] = {"kind": "continuation_logprob", **keys}
    cfg["eval"]["stages"]["pretrain"] = [*cfg["eval"]["stages"]["pretrain"], "toy"]
    return cfg


@torch.no_grad()
def _reference_logprob(ckpt, ctx: str, cont: str) -> float:
    """log P(cont | ctx) from the model and tokenizer files directly (no lm-eval adapter)."""
    from tokenizers import Tokenizer
    from stem.eval.lm import load_for_eval
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    tok.encode_special_tokens = True  # as the pipeline's tokenizer: special-token text is plain text
    model, _, _ = load_for_eval(str(ckpt), "cpu")
    c, whole = (tok.encode(s, add_special_tokens=False).ids for s in (ctx, ctx + cont))
    logp = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0].float(), -1)
    return sum(float(logp[i - 1, whole[i]]) for i in range(len(c), len(whole)))


def test_toy_suite_kind_runs_through_the_eval_job(toy_kind, ckpt, tmp_path, monkeypatch, capsys):
    from workflow_scripts import eval_suite
    from workflow_scripts._entry import run as run_entry

    cfg = C.experiment.parse(_cfg_with_toy_suite())  # the config check accepts the registered kind
    assert "results/tiny/1b/stem/pretrain/eval/toy.json" in ES.eval_targets(cfg)
    assert ES.rule_inputs(cfg, "tiny", "1b", "stem", "pretrain", "toy") == {
        "checkpoint": "results/tiny/1b/stem/pretrain/checkpoint", "pairs": "data/tiny/toy_pairs.json"}
    cfg = C.experiment.parse(_cfg_with_toy_suite(pairs_file=str(tmp_path / "pairs.json")))
    (tmp_path / "pairs.json").write_text(json.dumps(PAIRS))
    spec = ES.job_spec(cfg, "test", "1b", "stem", "pretrain", "toy")
    assert (spec["kind"], spec["suite"], spec["pairs_file"]) == (toy_kind, "toy", str(tmp_path / "pairs.json"))

    out, raw = tmp_path / "o" / "toy.json", tmp_path / "o" / "raw" / "toy.json"
    monkeypatch.setattr(sys, "argv", ["eval_suite", "--spec", json.dumps(spec), "--checkpoint", str(ckpt),
                                      "--out", str(out), "--raw", str(raw)])
    run_entry(eval_suite.main)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("toy: scores {'toy': ")
    saved = json.loads(out.read_text())
    ref = [_reference_logprob(ckpt, c, x) for c, x in PAIRS]
    assert json.loads(raw.read_text())["logprobs"] == pytest.approx(ref, abs=1e-4)
    assert saved["tasks"]["toy"]["value"] == pytest.approx(sum(ref) / 3, abs=1e-4) and saved["tasks"]["toy"]["n"] == 3
    assert [saved[k] for k in ("harness", "suite", "variant", "stage")] == ["tests.toy", "toy", "stem", "pretrain"]


def test_unregistered_kind_is_a_one_line_error(tmp_path):
    assert sorted(ES.SUITE_KINDS) == ["lm_eval", "longppl", "niah", "ppl"]  # the toy kind did not leak out of its test
    with pytest.raises(C.ConfigError, match=r"^config: key 'eval.suites.toy.kind': unknown suite kind "
                                            r"'continuation_logprob'; expected one of \['lm_eval', 'longppl', 'niah', 'ppl'\]$"):
        C.experiment.parse(_cfg_with_toy_suite())
    ES.suite_kind("continuation_logprob")(continuation_logprob)   # a config checked while its kind was registered
    cfg = C.experiment.parse(_cfg_with_toy_suite())
    ES.SUITE_KINDS.remove("continuation_logprob")
    with pytest.raises(ValueError, match=r"^suite 'toy': unknown kind 'continuation_logprob' \(expected one of"):
        ES.suite_spec(cfg, "toy")
    spec = {"kind": "nope", "suite": "s", "batch_size": 1}
    out = tmp_path / "s.json"
    known = r"\(expected one of \['lm_eval', 'longppl', 'niah', 'ppl'\]\)$"
    with pytest.raises(ValueError, match=r"^suite 's': unknown kind 'nope' " + known):
        run.evaluate(tmp_path / "no-checkpoint", spec, out)  # refused before the checkpoint is read
    assert not out.exists()


def test_a_kind_registers_once(toy_kind):
    with pytest.raises(ValueError, match="suite kind 'ppl': already registered"):
        ES.suite_kind("ppl")(continuation_logprob)
    assert ES.SUITE_KINDS["ppl"].runner == "stem.eval.ppl:run_ppl" and ES.SUITE_KINDS[toy_kind].runner is continuation_logprob
