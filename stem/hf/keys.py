"""Parameter names: the pipeline's model (stem.models.model) <-> transformers' Llama layout.

The pipeline's projections have the Llama shapes and the same rotate-half RoPE convention, so a weight moves
across unchanged; only its name differs. An FFN keeps its own parameter names under ``mlp.``, its projections
renamed as Llama's (stem/hf/remote/modeling_stem.py builds its modules with these names).
"""
from __future__ import annotations

import re

# (pipeline pattern, transformers pattern), applied in order to the part of a name after its layer prefix
_LAYER = [("attn_norm.weight", "input_layernorm.weight"), ("ffn_norm.weight", "post_attention_layernorm.weight"),
          ("attn.wq.weight", "self_attn.q_proj.weight"), ("attn.wk.weight", "self_attn.k_proj.weight"),
          ("attn.wv.weight", "self_attn.v_proj.weight"), ("attn.wo.weight", "self_attn.o_proj.weight")]
_FFN = [("w_gate.weight", "gate_proj.weight"), ("w_up.weight", "up_proj.weight"), ("w_down.weight", "down_proj.weight")]
_TOP = {"tok_emb.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight", "dse_compress": "dse_compress"}
_LAYER_RE = re.compile(r"^(layers\.\d+\.)(.*)$")
_HF_LAYER_RE = re.compile(r"^model\.(layers\.\d+\.)(.*)$")


def to_hf(name: str) -> str:
    """transformers' name of a pipeline parameter or buffer; ValueError naming it if it has none."""
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_RE.match(name)
    if m:
        prefix, rest = m.groups()
        for ours, theirs in _LAYER:
            if rest == ours:
                return f"model.{prefix}{theirs}"
        if rest.startswith("dse."):   # DSE memory: its own names under the decoder layer
            return f"model.{prefix}{rest}"
        if rest.startswith("ffn."):
            rest = rest[len("ffn."):]
            for ours, theirs in _FFN:
                if rest == ours or rest.endswith("." + ours):
                    rest = rest[: len(rest) - len(ours)] + theirs
                    break
            return f"model.{prefix}mlp.{rest}"
    raise ValueError(f"parameter {name!r}: no transformers counterpart")


def from_hf(name: str) -> str:
    """The pipeline's name of a transformers Llama-layout parameter; ValueError naming it if it has none."""
    top = {v: k for k, v in _TOP.items()}
    if name in top:
        return top[name]
    m = _HF_LAYER_RE.match(name)
    if m:
        prefix, rest = m.groups()
        for ours, theirs in _LAYER:
            if rest == theirs:
                return prefix + ours
        if rest.startswith("dse."):
            return prefix + rest
        if rest.startswith("mlp."):
            rest = rest[len("mlp."):]
            for ours, theirs in _FFN:
                if rest == theirs or rest.endswith("." + theirs):
                    rest = rest[: len(rest) - len(theirs)] + ours
                    break
            return f"{prefix}ffn.{rest}"
    raise ValueError(f"parameter {name!r}: not a Llama-architecture weight the pipeline's model has")
