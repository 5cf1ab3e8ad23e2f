"""Data stages of the workflow: synthetic corpora, tokenizers, token shards. Each takes a job spec."""
from __future__ import annotations

import shutil
import sys
import time
from itertools import chain
from pathlib import Path

from stem.data import synth
from stem.data.bios import make_bios, name_words
from stem.data.shards import tokenize_to_shards
from stem.data.sources import iter_documents
from stem.data.tokenizer import add_words, load_tokenizer, train_bpe
from stem.io import atomic_write_text
from stem.options import NameKind


def make_corpus(spec: dict, out_path) -> dict:
    w = spec.get("world", {})
    world = synth.make_world(**{k: w[k] for k in ("seed", "n_countries", "n_people", "n_filler") if k in w})
    # the generator's own keys: the source's reader keys (long: min/max_chars; bios: n, exposures, name_kind)
    # and the knowledge section's world (bios)
    kwargs = {k: v for k, v in spec.items() if k not in CORPUS_KEYS}
    docs = synth.GENERATORS[spec["generator"]](world, spec["seed"], **kwargs)
    # no bytes: the whole stream (a finite generator: bios writes N x E biographies)
    return synth.write_jsonl(out_path, docs, int(spec["bytes"]) if spec.get("bytes") else None)


# a corpus spec's keys that are not its generator's (stem.config.corpus_spec)
CORPUS_KEYS = ("source", "world", "seed", "kind", "generator", "bytes", "max_tokens", "parts", "doc_keys",
               "val_fraction", "sample", "plugins")


def make_tokenizer(spec: dict, out_path) -> dict:
    out_path = Path(out_path)
    if spec["kind"] == "train_bpe":
        docs = chain.from_iterable(iter_documents(d) for d in spec["documents"])
        train_bpe(docs, spec["vocab_size"], out_path)
        if spec.get("add_names"):   # the knowledge experiment: each name one token of its own (stem.data.bios)
            pair = make_bios({**spec["knowledge"], "name_kind": NameKind.PAIR}) if spec.get("add_pair_names") else None
            add_words(out_path, name_words(spec["knowledge"]) + (pair.words if pair else ()))
    elif spec.get("gguf_file"):  # the tokenizer of a GGUF file (the stage importing it reads the same file)
        from stem.hf.importer import gguf_tokenizer   # torch and transformers: only for a GGUF tokenizer
        atomic_write_text(out_path, gguf_tokenizer(spec["path"], spec["gguf_file"]))
    else:  # a tokenizer.json, a folder holding one, or a hub id
        atomic_write_text(out_path, load_tokenizer(spec["path"]).to_str())
    tok = load_tokenizer(out_path)
    return {"vocab_size": tok.vocab_size, "eos_id": tok.eos_id}


def tokenize(spec: dict, tokenizer_path, out_dir, workers: int = 2, log=None) -> dict:
    """Tokenize part ``spec["part"]`` = [k, n] of a source into ``out_dir``; print progress lines to ``log``."""
    tok = load_tokenizer(tokenizer_path)
    if tok.vocab_size > spec["vocab_size"]:
        raise ValueError(f"{tokenizer_path}: tokenizer has {tok.vocab_size} tokens but the model's "
                         f"vocab_size is {spec['vocab_size']} (raise archs.<scale>.vocab_size)")
    docs = spec["documents"]
    if docs["kind"] == "mds" and tok.vocab_size != docs["vocab_size"]:
        raise ValueError(f"{tokenizer_path}: tokenizer has {tok.vocab_size} tokens but the MDS source "
                         f"{docs['paths']} stores ids of a {docs['vocab_size']}-token vocabulary (use that tokenizer)")
    part = tuple(spec.get("part") or (0, 1))
    log = log or sys.stderr
    last = [0.0]

    def progress(st, final=False):
        if final or st["seconds"] - last[0] >= 10:
            last[0] = st["seconds"]
            print(f"tokenize part {part[0]}/{part[1]}: {st['documents']} documents, {st['tokens']} tokens, "
                  f"{st['tokens'] / max(st['seconds'], 1e-9):.0f} tokens/s", file=log, flush=True)

    max_tokens = int(spec["max_tokens"]) if spec.get("max_tokens") else None
    out_dir = Path(out_dir)
    for stale in out_dir.parent.glob(f".{out_dir.name}.tmp-*"):  # left by a killed run of this job
        shutil.rmtree(stale, ignore_errors=True)
    t0 = time.perf_counter()
    m = tokenize_to_shards(iter_documents(docs, part if part[1] > 1 else None), tok, out_dir,
                           seed=spec["seed"], num_workers=workers, max_tokens=max_tokens, source=docs,
                           doc_keys=spec.get("doc_keys", "index"), sample=spec.get("sample"),
                           **({"val_fraction": spec["val_fraction"]} if "val_fraction" in spec else {}),
                           allow_empty=part[1] > 1, progress=progress, extra={"part": list(part)})
    tokens = sum(s["tokens"] for s in m["splits"].values())
    progress({"documents": m["documents_seen"], "tokens": tokens, "seconds": time.perf_counter() - t0}, final=True)
    return m
