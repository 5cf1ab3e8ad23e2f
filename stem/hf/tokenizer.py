"""A checkpoint's tokenizer as transformers reads it: ``save_tokenizer`` writes the folder (``PreTrainedTokenizerFast``
files) that export-hf ships and that lm-eval's RULER generators load (``AutoTokenizer``) to size their items."""
from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast


def save_tokenizer(tok_file, eos_token: str, max_length: int, out) -> None:
    """The tokenizer.json ``tok_file`` as a transformers folder in ``out``."""
    out = Path(out)
    PreTrainedTokenizerFast(tokenizer_file=str(tok_file), eos_token=eos_token,
                            model_max_length=max_length).save_pretrained(out)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    # transformers 5 writes its new class name (TokenizersBackend); PreTrainedTokenizerFast, which it also
    # reads, is the name older transformers (and tools pinned to them) know
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
