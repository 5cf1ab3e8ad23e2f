"""Hugging Face export (stem.hf.export) and import: transformers loads what the pipeline trained with equal
logits (fp32), lm-eval's stock ``hf`` model scores as the ``stem`` model does."""
import copy
import functools
import json
import shutil

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from stem import config as C  # noqa: E402
from stem.data import synth  # noqa: E402
from stem.data.tokenizer import load_tokenizer, train_bpe  # noqa: E402
from stem.hf.export import REMOTE, REMOTE_FILES, export_hf  # noqa: E402
from conftest import reshaped  # noqa: E402
from stem.hf.importer import HF_KEY, import_hf  # noqa: E402
from stem.models.spec import ModelConfig  # noqa: E402
from stem.models import registry  # noqa: E402
from stem.models.ffn import StemTable  # noqa: E402
from stem.models.model import build_model  # noqa: E402
from stem.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402

WORLD = {"seed": 3, "n_countries": 8, "n_people": 20, "n_filler": 100}
ATOL, RTOL = 1e-4, 1e-5   # fp32 logits, transformers vs the pipeline (float round-off: RoPE frequencies in fp32 vs fp64)
VARIANTS = ["dense", "stem", "stem_gate", "stem_dagger", "stem_half", "stem_full", "hashmoe", "moe", "dse"]


@pytest.fixture(scope="module")
def tok_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    w = synth.make_world(**WORLD)
    train_bpe([doc for doc, _ in zip(synth.web_documents(w), range(200))], 320, d / "tokenizer.json")
    return d / "tokenizer.json"


@functools.lru_cache(maxsize=1)
def _tiny_yaml():
    return C.read_yaml(C.REPO / "config" / "tiny.yaml")


def tiny_cfg(variant, rope_scaling=None, **arch):
    cfg = copy.deepcopy(_tiny_yaml())
    cfg["archs"]["1b"].update(vocab_size=320, d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, d_ff=48,
                              max_seq_len=128, **arch)
    cfg["variant_overrides"] = {"hashmoe": {"n_experts": 3}, "moe": {"moe_experts": 4, "moe_d_ff": 24},
                                "dse": {"dse": {"rows_per_head": 101, "d_mem": 16, "heads": 2}}}
    if rope_scaling:   # a stage's key: pretraining's here (it sets no context of its own)
        cfg["stages"]["pretrain"]["1b"]["rope_scaling"] = rope_scaling
    return C.model_config_for(reshaped(cfg), "1b", variant, "pretrain").to_dict()


def make_ckpt(root, tok_file, variant="stem", seed=0, ffn=None, **arch):
    mc = tiny_cfg(variant, **arch) | ({"ffn": ffn} if ffn else {})
    torch.manual_seed(seed)
    model = build_model(ModelConfig.from_dict(mc), "cpu")
    with torch.no_grad():   # norms away from 1, so a misplaced norm weight shows; DSE's conv away from 0
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            elif name.endswith("conv.weight"):
                p.normal_(0, 0.3)
    if model.cfg.dse is not None:   # the tokenizer's vocabulary compression (merges some ids)
        model.set_dse_vocabulary(load_tokenizer(tok_file))
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
    tok_cfg = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and tok_cfg["eos_token"] == "<|endoftext|>"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=remote).eval()
    assert type(hf).__name__ == ("StemLlamaForCausalLM" if remote else "LlamaForCausalLM")
    with torch.no_grad():
        ours, theirs = model(IDS), hf(IDS).logits
    torch.testing.assert_close(theirs, ours, atol=ATOL, rtol=RTOL)
    # and back: import-hf of the exported folder gives the checkpoint's model (its weights bit for bit)
    import_hf(tmp_path / "hf", tmp_path / "back")
    again, spec = load_checkpoint(tmp_path / "back")
    if remote:   # the folder carries the pipeline's model config
        assert spec["model"] == json.loads(json.dumps(model.cfg.to_dict()))
    else:        # rebuilt from transformers' keys
        assert {k: spec["model"][k] for k in HF_KEY} == {k: getattr(model.cfg, k) for k in HF_KEY}
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


class GateTableFFN(nn.Module):
    """A kind the remote code has never seen, added through the registry: y = W_d(SiLU(W_g x + U[t]) * W_u x)."""

    def __init__(self, cfg, layer: int = 0):
        super().__init__()
        self.w_gate = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.w_up = nn.Linear(cfg.d_model, cfg.d_ff, bias=False)
        self.table = StemTable(cfg)
        self.w_down = nn.Linear(cfg.d_ff, cfg.d_model, bias=False)

    def forward(self, x, ids):
        return self.w_down(F.silu(self.w_gate(x) + self.table(ids)) * self.w_up(x))


def test_a_registered_kind_exports_by_its_declared_module_or_is_one_line(tok_file, tmp_path):
    """The remote code builds a layer from the module its kind declares in the registry (FFNFacts.hf, written into
    config.json as ffn_modules), naming no kind: a new kind declaring one exports with equal logits; a kind
    declaring none is refused in one line naming it, and nothing is written."""
    registry.declare_ffn("toy_gate_table", GateTableFFN, table=True, lookup=True,
                         hf={"module": "swiglu", "gate": ["proj", "table"], "up": ["proj"]})
    registry.declare_ffn("toy_no_hf", "stem.models.ffn:DenseFFN", table=False, lookup=False)
    try:
        ckpt, model = make_ckpt(tmp_path, tok_file, "dense", ffn=["dense", "toy_gate_table", "stem", "toy_gate_table"])
        assert export_hf(ckpt, tmp_path / "hf")["trust_remote_code"]
        cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
        assert cfg["ffn_modules"] == {k: registry.FFN_FACTS[k].hf for k in ("dense", "toy_gate_table", "stem")}
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
        with torch.no_grad():
            torch.testing.assert_close(hf(IDS).logits, model(IDS), atol=ATOL, rtol=RTOL)
        ckpt, _ = make_ckpt(tmp_path / "no", tok_file, "dense", ffn=["dense", "toy_no_hf", "dense", "dense"])
        with pytest.raises(ValueError, match=r"^ffn kind 'toy_no_hf': no transformers module declared \(hf=None; "
                                             r"expected declare_ffn/register_ffn\(\.\.\., hf=.*: export-hf exports "
                                             r"dense, stem, .*toy_gate_table$"):
            export_hf(ckpt, tmp_path / "no" / "hf")
        assert not (tmp_path / "no" / "hf").exists()
    finally:
        for kind in ("toy_gate_table", "toy_no_hf"):
            registry.FFN_KINDS.remove(kind)
            registry.FFN_FACTS.remove(kind)
    remote = [REMOTE / name for name in REMOTE_FILES] + [REMOTE.parent / "export.py"]
    assert not [(p.name, k) for p in remote for k in registry.FFN_KINDS if f'"{k}"' in p.read_text()]


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
        torch.testing.assert_close(hf.eval()(ids).logits, model(ids), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("variant", ["stem", "dse"])
def test_export_generation(variant, tok_file, tmp_path):
    """transformers' generate gives the pipeline's greedy tokens: STEM with its KV cache (each step's new ids
    reach the tables), DSE without one (the folder says use_cache: false; each step recomputes the prefix)."""
    from stem.eval.generate import greedy_generate
    ckpt, model = make_ckpt(tmp_path, tok_file, variant)
    export_hf(ckpt, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    assert hf.generation_config.use_cache is (variant != "dse")
    prompt = IDS[0, :12].tolist()
    ours = greedy_generate(model, prompt, 20, eos_id=None)
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert out[0, 12:].tolist() == ours


def test_export_needs_remote_code(tok_file, tmp_path):
    ckpt, _ = make_ckpt(tmp_path, tok_file, "stem")
    export_hf(ckpt, tmp_path / "hf")
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert cfg["model_type"] == "stem_llama" and cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_stem.StemLlamaForCausalLM"
    with pytest.raises(ValueError, match="trust_remote_code"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=False)


def test_lm_eval_hf_model_scores_as_the_stem_model(tok_file, tmp_path):
    """lm-eval's stock ``hf`` model (simple_evaluate(model="hf"), what `lm_eval --model hf` runs) on the folders
    `python -m stem export-hf` wrote (STEM: remote code; dense: stock Llama) scores a fixture task exactly as the
    ``stem`` model on the checkpoint: same acc / acc_norm, per-choice log-likelihoods within 1e-4."""
    import lm_eval.models  # noqa: F401 (registers lm-eval's own models, "hf" among them, beside "stem")
    from lm_eval import simple_evaluate

    from stem.__main__ import main as stem_main
    from stem.eval import fixtures, harness
    from stem.eval import spec as ES
    from stem.eval.lm import StemLM
    fixtures.write_fixtures({"world": WORLD, "seed": 0, "items": 8, "train_items": 2, "tasks": ["arc_easy"]},
                            tmp_path / "fx")
    cfg = C.experiment.load(C.REPO / "config" / "tiny.yaml")
    spec = {**ES.suite_spec(cfg, "commonsense"), "tasks": ["arc_easy"], "fixtures": str(tmp_path / "fx")}
    for variant in ("stem", "dense"):
        ckpt, _ = make_ckpt(tmp_path / variant, tok_file, variant, seed=5)
        out = tmp_path / variant / "hf"
        stem_main(["export-hf", str(ckpt), str(out)])   # python -m stem export-hf CHECKPOINT OUT
        ref = harness.run_lm_eval(StemLM(str(ckpt), device="cpu", batch_size=4), spec)
        got = simple_evaluate(model="hf", model_args={"pretrained": str(out), "dtype": "float32",
                                                      "trust_remote_code": variant != "dense"},
                              tasks=["arc_easy"], task_manager=harness.task_manager(spec["fixtures"]), device="cpu",
                              batch_size=3, num_fewshot=spec["num_fewshot"], random_seed=spec["seed"],
                              log_samples=True)
        assert got["config"]["model"] == "hf" and got["n-samples"]["arc_easy"]["effective"] == 8
        for a, b in zip(got["samples"]["arc_easy"], ref["samples"]["arc_easy"]):   # per item and choice
            assert a["doc_id"] == b["doc_id"]
            assert [float(x[0]) for x in a["resps"][0]] == pytest.approx([float(x[0]) for x in b["resps"][0]], abs=1e-4)
        for k in ("acc,none", "acc_norm,none"):
            assert got["results"]["arc_easy"][k] == ref["results"]["arc_easy"][k], (variant, k)


LLAMA3 = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


@pytest.mark.parametrize("tied,rope", [(True, "llama3"), (False, "llama3"), (True, "default"), (False, "default")])
def test_import_random_llama(tied, rope, tok_file, tmp_path, capsys):
    """A random LlamaForCausalLM saved by transformers (tied or untied, with or without llama3 RoPE scaling, as
    Llama-3.2-1B publishes it) imports with logits equal to transformers'; a tied model stays tied (tie_embeddings:
    one parameter), an untied one untied."""
    from stem.__main__ import main as stem_main
    rp = LLAMA3 if rope == "llama3" else {"rope_type": "default", "rope_theta": 50000.0}
    cfg = transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   rms_norm_eps=1e-5, rope_parameters=dict(rp), tie_word_embeddings=tied,
                                   bos_token_id=None, eos_token_id=0)
    torch.manual_seed(3)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            (p.uniform_(0.5, 1.5) if p.dim() == 1 else p.normal_(0, 0.2))
    hf.save_pretrained(tmp_path / "hf")
    shutil.copyfile(tok_file, tmp_path / "hf" / "tokenizer.json")
    stem_main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "ckpt")])
    assert "untied by copying" not in capsys.readouterr().err
    model, spec = load_checkpoint(tmp_path / "ckpt")
    assert model.cfg.rope_scaling.kind == ("llama3" if rope == "llama3" else "none")
    ids = torch.randint(0, 320, (2, 100), generator=torch.Generator().manual_seed(4))   # past the original 32
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids), hf(ids).logits, atol=ATOL, rtol=RTOL)
    assert model.cfg.tie_embeddings is tied
    assert (model.lm_head.weight is model.tok_emb.weight) is tied
    if tied and rope == "default":   # and out again: export-hf writes a tied stock Llama, no lm_head.weight
        export_hf(tmp_path / "ckpt", tmp_path / "out")
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
        assert back.config.tie_word_embeddings and back.lm_head.weight is back.model.embed_tokens.weight
        with torch.no_grad():
            torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=ATOL, rtol=RTOL)


def test_import_refuses_what_the_model_does_not_compute(tmp_path):
    from stem.hf.importer import check_arch, model_config
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                   num_attention_heads=2, attention_bias=True)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="key attention_bias=True"):
        model_config(tmp_path)
    c = json.loads((tmp_path / "config.json").read_text())
    c.update(attention_bias=False, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    (tmp_path / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="key rope_parameters.rope_type='dynamic'"):
        model_config(tmp_path)
    c["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    (tmp_path / "config.json").write_text(json.dumps(c))
    mc, _ = model_config(tmp_path)
    with pytest.raises(ValueError, match="key vocab_size=64: the stage's architecture has vocab_size=320"):
        check_arch(mc, ModelConfig.from_dict(tiny_cfg("dense")), tmp_path / "config.json")


def test_stage_init_from_hf(spec_factory, tmp_path):
    """A stage with init_from {hf: folder} (job spec "hf:folder") starts from the transformers weights: its model
    gives transformers' logits; a folder of other shapes stops the job with one line naming the key."""
    from stem.specs import TrainSpec
    from stem.train.loop import check_init_from, setup
    from stem.train.step import TrainingError
    spec = spec_factory(tmp_path / "run", variant="dense")
    m = spec["model"]
    cfg = transformers.LlamaConfig(vocab_size=m["vocab_size"], hidden_size=m["d_model"], intermediate_size=m["d_ff"],
                                   num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
                                   num_key_value_heads=m["n_kv_heads"], max_position_embeddings=m["max_seq_len"],
                                   rms_norm_eps=m["norm_eps"], rope_parameters={"rope_type": "default",
                                   "rope_theta": m["rope_theta"]}, tie_word_embeddings=True)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    spec.update(init_from=f"hf:{tmp_path / 'hf'}", init_stage=None)
    run = setup(TrainSpec.coerce(spec))
    ids = torch.randint(0, m["vocab_size"], (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(run.model.eval()(ids), hf(ids).logits, atol=ATOL, rtol=RTOL)
    # the import's parity against transformers' forward, on the stage's first held-out window
    assert run.import_parity["tokens"] > 1 and run.import_parity["max_abs_logit_diff"] < 1e-4
    # a stage that only imports (steps: 0, config/real.yaml's pretrain): no step; the summary has the parity and the
    # imported model's held-out loss, and passes the report's check
    from stem.report.results import check_summary
    from stem.train.loop import train
    imp = spec_factory(tmp_path / "imp", variant="dense")
    imp.update(init_from=f"hf:{tmp_path / 'hf'}", init_stage=None)
    imp["train"]["steps"] = 0
    out = train(imp)
    assert (out["steps"], out["tokens"], out["final_train_loss"]) == (0, 0, None) and 0 < out["final_val_loss"] < 20
    assert out["import_parity"]["max_abs_logit_diff"] < 1e-4
    check_summary("summary.json", json.loads((tmp_path / "imp" / "summary.json").read_text()),
                  {k: imp[k] for k in ("experiment", "scale", "variant", "stage")})
    # the official insertion path: the published dense model straight into a STEM variant (tied head untied)
    ins = spec_factory(tmp_path / "ins", variant="stem", stage="midtrain")
    ins.update(init_from=f"hf:{tmp_path / 'hf'}", init_stage=None, insert={"from": "dense", "init": "projected"})
    state = setup(TrainSpec.coerce(ins)).model.state_dict()
    layer = hf.model.layers[2]
    want = torch.nn.functional.linear(layer.post_attention_layernorm(hf.model.embed_tokens.weight),
                                      layer.mlp.up_proj.weight)
    torch.testing.assert_close(state["layers.2.ffn.table.weight"], want, atol=1e-6, rtol=1e-5)
    assert torch.equal(state["lm_head.weight"], hf.model.embed_tokens.weight)
    assert torch.equal(state["layers.2.ffn.w_gate.weight"], layer.mlp.gate_proj.weight)
    cfg.intermediate_size = 64
    cfg.save_pretrained(tmp_path / "hf")
    with pytest.raises(TrainingError, match=r"config.json: key intermediate_size=64: the stage's architecture has d_ff=48"):
        check_init_from(TrainSpec.coerce(spec))


def test_llama3_rope_matches_transformers():
    """stem.models.rope's llama3 frequencies against transformers' own function (Llama-3.2-1B's settings too)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from stem.models.spec import RopeScaling
    from stem.models.rope import inv_frequencies
    for hd, theta, f, lo, hi, length in [(64, 500000.0, 32.0, 1.0, 4.0, 8192), (16, 1e4, 8.0, 1.0, 4.0, 64),
                                         (32, 1e4, 4.0, 2.0, 8.0, 100)]:
        c = transformers.LlamaConfig(hidden_size=2 * hd, num_attention_heads=2, max_position_embeddings=4 * length,
                                     rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": f,
                                                      "low_freq_factor": lo, "high_freq_factor": hi,
                                                      "original_max_position_embeddings": length})
        theirs, scale = ROPE_INIT_FUNCTIONS["llama3"](c)
        ours, mscale = inv_frequencies(hd, theta, RopeScaling(kind="llama3", factor=f, low_freq_factor=lo,
                                                              high_freq_factor=hi, original_max_seq_len=length))
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
        assert mscale == scale == 1.0
        assert not torch.allclose(ours, inv_frequencies(hd, theta, RopeScaling())[0])   # it does scale


def test_cli_errors_are_one_line_and_write_nothing(tok_file, tmp_path, capsys):
    from stem.__main__ import main as stem_main
    for argv, message in [(["export-hf", str(tmp_path / "nope"), str(tmp_path / "out")], "not a checkpoint folder"),
                          (["import-hf", str(tmp_path / "nope"), str(tmp_path / "out")], "no such folder")]:
        with pytest.raises(SystemExit) as e:
            stem_main(argv)
        err = capsys.readouterr().err.strip()
        assert e.value.code == 1 and message in err and len(err.splitlines()) == 1, err
        assert not (tmp_path / "out").exists()


def test_hf_parity_analysis_on_a_facts_task(tok_file, tmp_path):
    """The hf_parity analysis (config/real.yaml): a STEM checkpoint and its export-hf folder score a local lm-eval
    task made from a prompt-set file the same under lm-eval's stock ``hf`` model and the ``stem`` model; the JSON
    holds both metrics and the per-request loglikelihoods; a folder that is not the checkpoint's export is one line."""
    from stem.__main__ import main as stem_main
    from stem.analysis.hf_parity import check, compare
    facts = tmp_path / "facts.yaml"
    facts.write_text("kinds:\n  place:\n    templates: {capital: 'The capital of {e} is'}\n    entities:\n"
                     "      Spain: {capital: ' Madrid'}\n      Germany: {capital: ' Berlin'}\n"
                     "      France: {capital: ' Paris'}\n")
    ckpt, _ = make_ckpt(tmp_path / "stem", tok_file, "stem", seed=4)
    stem_main(["export-hf", str(ckpt), str(tmp_path / "hf")])
    r = compare(ckpt, tmp_path / "hf", facts, tolerance=1e-4, batch_size=2)
    assert r["documents"] == 3 and len(r["loglik"]["hf"]) == 3 and r["within_tolerance"]
    assert r["max_abs_loglik_diff"] <= 1e-4 and r["hf"]["acc"] == r["stem"]["acc"]
    assert r["hf"]["perplexity"] == pytest.approx(r["stem"]["perplexity"], rel=1e-4)
    off = [x + 2e-4 * (i == 1) for i, x in enumerate(r["loglik"]["stem"])]   # one request 2e-4 away, one missing
    for stem_ll, hf_ll in ((off, r["loglik"]["hf"]), (r["loglik"]["stem"], r["loglik"]["hf"][:2])):
        with pytest.raises(ValueError, match=r"hf_parity X: max \|loglikelihood difference\|.* expected <= 0.0001"):
            check(stem_ll, hf_ll, 3, 1e-4, "X")
