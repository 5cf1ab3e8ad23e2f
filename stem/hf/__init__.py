"""Hugging Face transformers in and out (docs/huggingface.md).

- ``stem.hf.export``: a checkpoint folder -> a transformers folder (``python -m stem export-hf``): dense models as
  a stock ``LlamaForCausalLM``, every other FFN kind through the modeling code in ``stem/hf/remote/``
  (``auto_map``, ``trust_remote_code=True``).
- ``stem.hf.keys``: the parameter names of the two layouts.
"""
