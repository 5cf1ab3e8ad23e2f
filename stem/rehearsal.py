"""Offline inputs of the one-node rehearsal (config/rehearsal.yaml, docs/gpu.md), in the paper's formats.

``python -m stem rehearsal-data`` writes under ``data/rehearsal/hub`` what the paper run downloads:

- ``tokenizer-350m/tokenizer.json`` and ``tokenizer-1b/tokenizer.json``: byte-level BPE tokenizers trained on
  the synthetic world's text, their vocabularies padded with reserved tokens to the paper's sizes (32,000 as
  Llama-2's, 128,256 as Llama-3's), so the token shards, embeddings and heads have the paper's widths (the 1B
  shards are uint32, as with Llama-3);
- ``prolong-data-64K/{long,short}/proc00-64``: ProLong-shaped MDS folders written with mosaicml-streaming's
  ``MDSWriter``: rows of 65,536 ids of the 1B tokenizer with the packed documents' (start, end) pairs.
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np

from stem import layout as L
from stem.data.sources import streaming_format
from stem.data.synth import GENERATORS, make_world
from stem.data.tokenizer import load_tokenizer, train_bpe
from stem.io import atomic_dir, atomic_write_text

ROOT = Path(L.REHEARSAL_HUB)
VOCAB = {"350m": 32000, "1b": 128256}            # the paper's tokenizers (config/paper.yaml)
BPE_VOCAB = 4096                                  # merges learnt from the synthetic text; the rest reserved
ROW = 65536                                       # ProLong-data-64K's row length
MDS_COLUMNS = {"input_ids": "ndarray:uint32", "indices": "ndarray:uint32", "length": "uint64", "domain": "str"}
WORLD = {"seed": 7, "n_countries": 40, "n_people": 200, "n_filler": 2000}   # config/tiny.yaml's world


def padded_tokenizer(docs, vocab_size: int, out_path: Path) -> None:
    """A BPE tokenizer of BPE_VOCAB learnt tokens whose vocabulary is padded with ``<|reserved_i|>`` entries
    (never produced by encoding) to exactly ``vocab_size`` ids."""
    tmp = out_path.parent / ".bpe.json"
    train_bpe(docs, BPE_VOCAB, tmp)
    spec = json.loads(tmp.read_text())
    vocab = spec["model"]["vocab"]
    n = len(vocab) + sum(1 for t in spec.get("added_tokens", []) if t["content"] not in vocab)
    for i in range(vocab_size - n):
        vocab[f"<|reserved_{i}|>"] = n + i
    atomic_write_text(out_path, json.dumps(spec, ensure_ascii=False))
    tmp.unlink()
    got = load_tokenizer(out_path).vocab_size
    if got != vocab_size:
        raise RuntimeError(f"{out_path}: padded vocabulary has {got} tokens, expected {vocab_size}")


def write_mds(folder: Path, tok, docs, rows: int, domain: str) -> None:
    """``rows`` rows of ROW packed ids (documents cut at the row's end) with their (start, end) pairs."""
    fmt = streaming_format()
    with atomic_dir(folder, prefix=".tmp_mds_") as tmp:
        with fmt.MDSWriter(out=str(tmp), columns=MDS_COLUMNS, size_limit=1 << 24) as w:
            for _ in range(rows):
                ids, bounds = [], []
                while len(ids) < ROW:
                    doc = tok.encode_batch([next(docs)])[0][: ROW - len(ids)]
                    bounds.append((len(ids), len(ids) + len(doc)))
                    ids += doc
                w.write({"input_ids": np.array(ids, np.uint32), "indices": np.array(bounds, np.uint32),
                         "length": ROW, "domain": domain})


def prepare(root=ROOT, mds_rows: int = 8, log=print) -> dict:
    """Write the rehearsal's tokenizers and MDS folders under ``root`` (skipping what exists)."""
    root = Path(root)
    world = make_world(**WORLD)
    out = {}
    for scale, v in VOCAB.items():
        path = root / f"tokenizer-{scale}" / "tokenizer.json"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            docs = itertools.islice(GENERATORS["web"](world, 1), 3000)
            padded_tokenizer(docs, v, path)
            log(f"rehearsal-data: {path} ({v} tokens)")
        out[f"tokenizer_{scale}"] = str(path)
    tok = load_tokenizer(root / "tokenizer-1b" / "tokenizer.json")
    for domain, gen in (("long", "long"), ("short", "web")):
        folder = root / "prolong-data-64K" / domain / "proc00-64"
        if not (folder / "index.json").is_file():
            kwargs = {"min_chars": 8000, "max_chars": 60000} if gen == "long" else {}
            write_mds(folder, tok, GENERATORS[gen](world, 2, **kwargs), mds_rows, domain)
            log(f"rehearsal-data: {folder} ({mds_rows} rows of {ROW} ids)")
        out[f"mds_{domain}"] = str(folder)
    return out
