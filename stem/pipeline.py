"""Data stages of the workflow: synthetic corpora, tokenizers, token shards. Each takes a job spec."""
from __future__ import annotations

from itertools import chain
from pathlib import Path

from stem.data import synth
from stem.data.shards import tokenize_to_shards
from stem.data.sources import iter_documents
from stem.data.tokenizer import load_tokenizer, train_bpe
from stem.train.checkpoint import atomic_write_text


def make_corpus(spec: dict, out_path) -> dict:
    w = spec.get("world", {})
    world = synth.make_world(**{k: w[k] for k in ("seed", "n_countries", "n_people", "n_filler") if k in w})
    kwargs = {k: spec[k] for k in ("min_chars", "max_chars") if k in spec}
    docs = synth.GENERATORS[spec["generator"]](world, spec["seed"], **kwargs)
    return synth.write_jsonl(out_path, docs, int(spec["bytes"]))


def make_tokenizer(spec: dict, out_path) -> dict:
    out_path = Path(out_path)
    if spec["kind"] == "train_bpe":
        docs = chain.from_iterable(iter_documents(d) for d in spec["documents"])
        train_bpe(docs, spec["vocab_size"], out_path)
    else:  # a tokenizer.json, a folder holding one, or a hub id
        atomic_write_text(out_path, load_tokenizer(spec["path"]).to_str())
    tok = load_tokenizer(out_path)
    return {"vocab_size": tok.vocab_size, "eos_id": tok.eos_id}


def tokenize(spec: dict, tokenizer_path, out_dir, workers: int = 2) -> dict:
    tok = load_tokenizer(tokenizer_path)
    if tok.vocab_size > spec["vocab_size"]:
        raise ValueError(f"{tokenizer_path}: tokenizer has {tok.vocab_size} tokens but the model's "
                         f"vocab_size is {spec['vocab_size']} (raise archs.<scale>.vocab_size)")
    max_tokens = int(spec["max_tokens"]) if spec.get("max_tokens") else None
    return tokenize_to_shards(iter_documents(spec["documents"]), tok, out_dir, seed=spec["seed"],
                              num_workers=workers, max_tokens=max_tokens, source=spec["documents"])
