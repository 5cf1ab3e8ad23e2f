"""Hugging Face export (stem.hf.export) and import: transformers loads what the pipeline trained with equal
logits (fp32), lm-eval's stock ``hf`` model scores as the ``stem`` model does."""
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


def tiny_cfg(variant, **arch):
    cfg = C.load_experiment(C.REPO / "config" / "tiny.yaml")
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
