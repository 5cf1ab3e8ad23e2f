"""A training-stage checkpoint -> a transformers model folder (``python -m stem export-hf CHECKPOINT OUT``).

- a model whose every FFN is transformers' Llama MLP (its kind's registered ``hf`` module is ``LLAMA_MLP``), with a
  RoPE transformers has (none, theta, linear, yarn with ``ramp: dims``, llama3): a stock ``LlamaForCausalLM``
  folder that ``AutoModelForCausalLM.from_pretrained(OUT)`` loads without remote code;
- any other FFN kind (any placement), and a model with the YaRN paper's ramp (``ramp: rotations``, which
  transformers' ``yarn`` does not implement): the same Llama layout plus ``configuration_stem.py`` /
  ``modeling_stem.py`` (stem/hf/remote/) named in ``auto_map`` (``trust_remote_code=True``). The config says
  per layer its kind (``ffn_kinds``) and per kind the module the remote code builds (``ffn_modules``: the
  registry's ``FFNFacts.hf``, stem.models.registry), so the remote code names no kind; a kind registered without
  ``hf`` is not exported (one line);
- DSE (hashed N-gram memory) travels in the remote code too (hash constants in the config, ``dse_hash``); it keeps
  no incremental state there, so the folder says ``use_cache: false`` (generation recomputes the prefix).

The folder holds config.json, model.safetensors (fp32, the checkpoint's tensors renamed: stem.hf.keys),
generation_config.json and the tokenizer as ``PreTrainedTokenizerFast`` files, and ``stem_source.json`` (what it
was exported from: the mark of an export); it is written atomically. OUT must not exist, or be an empty folder or
a previous export (replaced); anything else is refused (``force``: replace it). The temp folders an interrupted
export left beside OUT are removed.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file
from transformers import GenerationConfig, LlamaConfig

from stem.data.tokenizer import load_tokenizer
from stem.hf.keys import to_hf
from stem.hf.remote.configuration_stem import StemLlamaConfig
from stem.hf.remote.modeling_stem import MODULES
from stem.hf.tokenizer import save_tokenizer
from stem.io import atomic_dir
from stem.models.spec import ModelConfig
from stem.models.model import saved_state
from stem.models.registry import FFN_FACTS, ffn_facts
from stem.checkpoint import load_checkpoint

REMOTE = Path(__file__).parent / "remote"
REMOTE_FILES = ("configuration_stem.py", "modeling_stem.py")
AUTO_MAP = {"AutoConfig": "configuration_stem.StemLlamaConfig",
            "AutoModelForCausalLM": "modeling_stem.StemLlamaForCausalLM"}


def hf_rope(cfg: ModelConfig) -> tuple[dict, dict | None]:
    """(transformers ``rope_parameters``, ``stem_rope``): the second is the pipeline's own scaling, carried by the
    remote code, where transformers has no rope type that computes the same frequencies (the YaRN paper's ramp)."""
    r, theta = cfg.rope_scaling, float(cfg.rope_theta)
    if r.kind == "none":
        return {"rope_type": "default", "rope_theta": theta}, None
    if r.kind == "theta":
        return {"rope_type": "default", "rope_theta": float(r.theta)}, None
    if r.kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": float(r.factor)}, None
    if r.kind == "llama3":
        return {"rope_type": "llama3", "rope_theta": theta, "factor": float(r.factor),
                "low_freq_factor": float(r.low_freq_factor), "high_freq_factor": float(r.high_freq_factor),
                "original_max_position_embeddings": int(r.original_max_seq_len)}, None
    if r.kind == "yarn" and r.ramp == "dims":   # transformers' yarn: ramp linear in the (floored/ceiled) dimension
        return {"rope_type": "yarn", "rope_theta": theta, "factor": float(r.factor), "beta_fast": float(r.beta_fast),
                "beta_slow": float(r.beta_slow), "original_max_position_embeddings": int(r.original_max_seq_len),
                "truncate": True}, None
    if r.kind == "yarn":   # ramp: rotations
        return {"rope_type": "default", "rope_theta": theta}, {
            "factor": float(r.factor), "beta_fast": float(r.beta_fast), "beta_slow": float(r.beta_slow),
            "original_max_seq_len": int(r.original_max_seq_len)}
    raise ValueError(f"rope_scaling.kind={r.kind!r}: no transformers equivalent")


LLAMA_MLP = {"module": "swiglu", "gate": ["proj"], "up": ["proj"]}   # transformers' LlamaMLP computes this one


def ffn_modules(cfg: ModelConfig) -> dict[str, dict]:
    """{kind: the module the remote code builds for it} of the model's FFN kinds (the registry's FFNFacts.hf);
    a one-line ValueError for a kind that declares none, or one the remote code cannot build."""
    out = {}
    for kind in dict.fromkeys(cfg.ffn):
        spec = ffn_facts(kind).hf
        if spec is None or spec.get("module") not in MODULES:
            can = ", ".join(k for k in FFN_FACTS if FFN_FACTS[k].hf is not None)
            raise ValueError(f"ffn kind {kind!r}: no transformers module declared (hf={spec!r}; expected "
                             f"declare_ffn/register_ffn(..., hf={{'module': one of {', '.join(MODULES)}, ...}}): "
                             f"export-hf exports {can}")
        out[kind] = spec
    return out


def needs_remote_code(cfg: ModelConfig) -> bool:
    return (any(spec != LLAMA_MLP for spec in ffn_modules(cfg).values()) or hf_rope(cfg)[1] is not None
            or cfg.dse is not None)


def dse_hash(model) -> dict | None:
    """Per DSE layer its hash constants (table primes, multipliers): buffers the pipeline recomputes from the seed
    and does not save, so the remote code reads them from the config."""
    if model.cfg.dse is None:
        return None
    return {str(i): {"primes": model.layers[i].dse.primes.tolist(), "multipliers": model.layers[i].dse.multipliers.tolist()}
            for i in model.cfg.dse.layers}


def hf_config(cfg: ModelConfig, eos_id: int, dse: dict | None = None):
    """The transformers config of a pipeline model (LlamaConfig, or StemLlamaConfig with its auto_map)."""
    rope, stem_rope = hf_rope(cfg)
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.d_ff,
                  num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_kv_heads,
                  head_dim=cfg.head_dim, max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
                  rope_parameters=rope, tie_word_embeddings=cfg.tie_embeddings, bos_token_id=None, eos_token_id=eos_id,
                  pad_token_id=None, initializer_range=cfg.init_std, dtype="float32")
    if not needs_remote_code(cfg):
        return LlamaConfig(**common, architectures=["LlamaForCausalLM"])
    out = StemLlamaConfig(**common, architectures=["StemLlamaForCausalLM"], ffn_kinds=list(cfg.ffn),
                          ffn_modules=ffn_modules(cfg),
                          n_experts=cfg.n_experts, moe_experts=cfg.moe_experts, moe_shared=cfg.moe_shared,
                          moe_top_k=cfg.moe_top_k, moe_d_ff=cfg.moe_d_ff, stem_rope=stem_rope,
                          stem_model=cfg.to_dict(), dse_hash=dse,
                          use_cache=dse is None)   # DSE: no incremental state in the remote code
    out.auto_map = dict(AUTO_MAP)
    return out


def hf_state_dict(model) -> dict:
    """The model's saved tensors under transformers' names (fp32, contiguous, on the CPU)."""
    state = {}
    for name, t in saved_state(model.state_dict(), model.cfg).items():
        if name == "dse_compress" and model.cfg.dse is None:
            continue   # a buffer saved only for DSE models
        state[to_hf(name)] = t.detach().float().contiguous().cpu() if t.is_floating_point() else t.contiguous().cpu()
    return state


SOURCE_FILE = "stem_source.json"   # in every export folder: what it was exported from


def check_out(out: Path, force: bool = False) -> None:
    """One line unless ``out`` is free to write: nothing there, an empty folder, a previous export (its
    stem_source.json) or ``force``; then the temp folders an interrupted export left beside it are removed."""
    if out.is_symlink() or out.exists():
        what = ("a file" if not out.is_dir() else None if not any(out.iterdir()) or (out / SOURCE_FILE).is_file()
                else f"a folder that is not an export (no {SOURCE_FILE})")
        if what and not force:
            raise ValueError(f"export-hf OUT {out}: {what}; expected a new path, an empty folder or a previous "
                             "export (--force replaces it, or remove it)")
    for stale in list(out.parent.glob(f".{out.name}.tmp-*")) + list(out.parent.glob(f".{out.name}.old-*")):
        shutil.rmtree(stale, ignore_errors=True)


def export_hf(checkpoint, out, force: bool = False) -> dict:
    """Write the transformers folder ``out`` for the checkpoint folder ``checkpoint``; returns a summary.
    ``force``: replace whatever is at ``out`` (else only a previous export or an empty folder, ``check_out``)."""
    checkpoint, out = Path(checkpoint), Path(out)
    check_out(out, force)
    model, spec = load_checkpoint(checkpoint, "cpu")
    tok_file = checkpoint / "tokenizer.json"
    if not tok_file.is_file():
        raise ValueError(f"{tok_file}: missing (the checkpoint's tokenizer is exported with it)")
    tok = load_tokenizer(tok_file)
    config = hf_config(model.cfg, tok.eos_id, dse_hash(model))
    remote = isinstance(config, StemLlamaConfig)
    with atomic_dir(out) as tmp:
        config.save_pretrained(tmp)
        save_file(hf_state_dict(model), str(tmp / "model.safetensors"), metadata={"format": "pt"})
        GenerationConfig(eos_token_id=tok.eos_id, bos_token_id=None, pad_token_id=None, do_sample=False,
                         use_cache=model.cfg.dse is None).save_pretrained(tmp)
        save_tokenizer(tok_file, tok.eos_token, model.cfg.max_seq_len, tmp)
        for name in REMOTE_FILES if remote else ():
            shutil.copyfile(REMOTE / name, tmp / name)
        (tmp / SOURCE_FILE).write_text(json.dumps(
            {k: spec.get(k) for k in ("experiment", "scale", "variant", "stage")} | {"checkpoint": str(checkpoint)},
            indent=2) + "\n")
    return {"out": str(out), "architecture": config.architectures[0], "trust_remote_code": remote,
            "rope_parameters": config.rope_parameters, "stem_rope": getattr(config, "stem_rope", None),
            "variant": spec.get("variant"), "stage": spec.get("stage")}
