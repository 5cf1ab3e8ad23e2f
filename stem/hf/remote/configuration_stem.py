"""Configuration of a STEM-pipeline model exported for transformers (``trust_remote_code=True``).

Written by ``python -m stem export-hf`` next to ``modeling_stem.py``. A Llama configuration plus:
``ffn_kinds`` (one FFN kind per layer), ``ffn_modules`` (per kind, the module ``modeling_stem.py`` builds: data
from the pipeline's registry, stem.models.registry.FFNFacts.hf), the expert counts and sizes (``n_experts``,
``moe_experts``, ``moe_shared``, ``moe_top_k``, ``moe_d_ff``), ``stem_rope`` (the pipeline's RoPE scaling when
transformers has no equivalent: the YaRN paper's ramp, ``ramp: rotations``) and ``stem_model`` (the pipeline's own
model config, for importing the folder back).
"""
from transformers import LlamaConfig


class StemLlamaConfig(LlamaConfig):
    model_type = "stem_llama"
