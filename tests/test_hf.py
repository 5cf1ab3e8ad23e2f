"""Hugging Face export (stem.hf.export) and import: transformers loads what the pipeline trained with equal
logits (fp32), lm-eval's stock ``hf`` model scores as the ``stem`` model does."""
import copy
import functools
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from stem import config as C  # noqa: E402
from stem.data import synth  # noqa: E402
from stem.data.tokenizer import train_bpe  # noqa: E402
from stem.hf.export import export_hf  # noqa: E402
from stem.models.config import ModelConfig  # noqa: E402
from stem.models.model import build_model  # noqa: E402
from stem.train.checkpoint import save_checkpoint  # noqa: E402

WORLD = {"seed": 3, "n_countries": 8, "n_people": 20, "n_filler": 100}
ATOL = 1e-5   # fp32 logits, transformers' Llama vs the pipeline's model (float round-off only)
VARIANTS = ["dense", "stem", "stem_gate", "stem_dagger", "stem_half", "stem_full", "hashmoe", "moe"]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    w = synth.make_world(**WORLD)
    train_bpe([doc for doc, _ in zip(synth.web_documents(w), range(200))], 320, d / "tokenizer.json")
    return d / "tokenizer.json"


@functools.lru_cache(maxsize=1)
def _tiny_yaml():
    return C.load_experiment(C.REPO / "config" / "tiny.yaml")


def tiny_cfg(variant, **arch):
    cfg = copy.deepcopy(_tiny_yaml())
    cfg["archs"]["1b"].update(vocab_size=320, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48,
                              max_seq_len=128, **arch)
    cfg["variant_overrides"] = {"hashmoe": {"n_experts": 3}, "moe": {"moe_experts": 4, "moe_d_ff": 24}}
    return C.model_config_for(cfg, "1b", variant).to_dict()


def make_ckpt(root, tok_file, variant="stem", seed=0, **arch):
    mc = tiny_cfg(variant, **arch)
    torch.manual_seed(seed)
    model = build_model(ModelConfig.from_dict(mc), "cpu")
    with torch.no_grad():   # norms away from 1, so a misplaced norm weight shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
    spec = {"experiment": "test", "scale": "1b", "variant": variant, "stage": "pretrain", "model": mc}
    save_checkpoint(root / "checkpoint", model, spec, tok_file, {})
    return root / "checkpoint", model.eval()


IDS = torch.randint(0, 320, (2, 40), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_logits_equal(variant, tok_file, tmp_path):
    ckpt, model = make_ckpt(tmp_path, tok_file, variant)
    info = export_hf(ckpt, tmp_path / "hf")
    remote = variant != "dense"
    assert info["trust_remote_code"] is remote
    files = {p.name for p in (tmp_path / "hf").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert ("modeling_stem.py" in files) is remote
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=remote).eval()
    assert type(hf).__name__ == ("StemLlamaForCausalLM" if remote else "LlamaForCausalLM")
    with torch.no_grad():
        ours, theirs = model(IDS), hf(IDS).logits
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=0)


ROPES = {"theta": {"kind": "theta", "theta": 40000.0}, "linear": {"kind": "linear", "factor": 2.0},
         "yarn_dims": {"kind": "yarn", "factor": 4.0, "original_max_seq_len": 32, "ramp": "dims"},
         "yarn_paper": {"kind": "yarn", "factor": 4.0, "original_max_seq_len": 32}}


@pytest.mark.parametrize("rope", ROPES)
def test_export_rope_scaling(rope, tok_file, tmp_path):
    """transformers' own rope type where it computes the same frequencies; the YaRN paper's ramp (linear in the
    rotation count) is not transformers' yarn (linear in the dimension), so it travels in the remote code."""
    ckpt, model = make_ckpt(tmp_path, tok_file, "dense", rope_scaling=ROPES[rope])
    info = export_hf(ckpt, tmp_path / "hf")
    assert info["trust_remote_code"] is (rope == "yarn_paper")
    expected = {"theta": "default", "linear": "linear", "yarn_dims": "yarn", "yarn_paper": "default"}[rope]
    assert info["rope_parameters"]["rope_type"] == expected
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=info["trust_remote_code"])
    ids = torch.randint(0, 320, (1, 120), generator=torch.Generator().manual_seed(2))   # past the original 32
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, model(ids), atol=ATOL, rtol=0)


def test_export_generation_with_cache(tok_file, tmp_path):
    """transformers' generate (its KV cache, token ids of each step reaching the STEM tables) gives the
    pipeline's greedy tokens."""
    from stem.eval.generate import greedy_generate
    ckpt, model = make_ckpt(tmp_path, tok_file, "stem")
    export_hf(ckpt, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    prompt = IDS[0, :12].tolist()
    ours = greedy_generate(model, prompt, 20, eos_id=None)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert out[0, 12:].tolist() == ours


def test_export_refuses_dse_and_needs_remote_code(tok_file, tmp_path):
    from stem.hf.export import hf_config
    mc = ModelConfig.from_dict({**tiny_cfg("dense"), "dse": {"layers": [1], "rows_per_head": 11, "d_mem": 8,
                                                              "heads": 2}})
    with pytest.raises(ValueError, match="DSE memory at layers \\[1\\]"):
        hf_config(mc, 0)
    ckpt, _ = make_ckpt(tmp_path, tok_file, "stem")
    export_hf(ckpt, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "stem_llama" and cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_stem.StemLlamaForCausalLM"
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=False)


def test_stock_lm_eval_hf_scores_as_the_stem_model(tok_file, tmp_path):
    """`lm_eval --model hf` (lm-eval's stock command, a subprocess) on the folder `python -m stem export-hf`
    wrote (a STEM model: remote code) scores a fixture task exactly as `--model stem` on the checkpoint; the
    dense export goes through simple_evaluate(model="hf") without remote code."""
    import os
    import subprocess
    import sys

    import lm_eval.models  # noqa: F401 (registers lm-eval's own models, "hf" among them, beside "stem")
    from lm_eval import simple_evaluate

    from stem.__main__ import main as stem_main

    from stem.eval import fixtures, run
    from stem.eval.lm import StemLM
    fixtures.write_fixtures({"world": WORLD, "seed": 0, "items": 8, "train_items": 2, "tasks": ["arc_easy"]},
                            tmp_path / "fx")
    cfg = C.load_experiment(C.REPO / "config" / "tiny.yaml")
    spec = {**run.suite_spec(cfg, "commonsense"), "tasks": ["arc_easy"], "fixtures": str(tmp_path / "fx")}
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(C.REPO), "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    for variant in ("stem", "dense"):
        ckpt, _ = make_ckpt(tmp_path / variant, tok_file, variant, seed=5)
        out = tmp_path / variant / "hf"
        stem_main(["export-hf", str(ckpt), str(out)])   # python -m stem export-hf CHECKPOINT OUT
        ref = run.run_lm_eval(StemLM(str(ckpt), device="cpu", batch_size=4), spec)
        if variant == "stem":
            r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                                f"pretrained={out},trust_remote_code=True,dtype=float32", "--tasks", "arc_easy",
                                "--include_path", str(tmp_path / "fx"), "--device", "cpu", "--batch_size", "3",
                                "--output_path", str(tmp_path / "out")],
                               capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
            assert r.returncode == 0, r.stderr[-3000:]
            (res_file,) = (tmp_path / "out").rglob("results_*.json")
            got = json.loads(res_file.read_text())
            assert got["config"]["model"] == "hf"
        else:
            got = simple_evaluate(model="hf", model_args={"pretrained": str(out), "dtype": "float32"}, tasks=["arc_easy"],
                                  task_manager=run.task_manager(spec["fixtures"]), device="cpu", batch_size=3,
                                  num_fewshot=spec["num_fewshot"], random_seed=spec["seed"], log_samples=True)
            for a, b in zip(got["samples"]["arc_easy"], ref["samples"]["arc_easy"]):   # per item and choice
                assert [float(x[0]) for x in a["resps"][0]] == pytest.approx(
                    [float(x[0]) for x in b["resps"][0]], abs=1e-4)
        assert got["n-samples"]["arc_easy"]["effective"] == 8
        for k in ("acc,none", "acc_norm,none"):
            assert got["results"]["arc_easy"][k] == ref["results"]["arc_easy"][k], (variant, k)
