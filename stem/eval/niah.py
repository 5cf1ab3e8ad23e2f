"""Needle-in-a-haystack for base models (RULER-style completion with key/value needles).

For each (context length, depth) cell, ``samples`` haystacks of ``length`` tokens are cut from the
configured corpus; a needle "One of the special magic numbers for {key} is: {value}." is inserted at
``depth`` percent (at a sentence boundary), and the prompt ends with the completion query
"The special magic number for {key} mentioned in the provided text is". Greedy decoding; a cell's
accuracy is the share of outputs that contain the value (exact match of the 7-digit number).
"""
from __future__ import annotations

import random


def make_items(tok, documents, lengths, depths, samples: int, seed: int = 0) -> list[dict]:
    """Prompts of exactly-budgeted token length (haystack + needle + query <= length - 8)."""
    rng = random.Random(f"niah:{seed}")
    pool = " ".join(documents).split(". ")
    items = []
    for length in lengths:
        for depth in depths:
            for s in range(samples):
                key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8))
                value = str(rng.randint(1_000_000, 9_999_999))
                needle = f"One of the special magic numbers for {key} is: {value}."
                query = (f"\n\nWhat is the special magic number for {key} mentioned in the provided text? "
                         f"The special magic number for {key} mentioned in the provided text is")
                budget = length - 8 - len(tok.encode_batch([needle + " " + query])[0])
                if budget <= 0:
                    raise ValueError(f"niah: length {length} leaves no room for a haystack beside needle and query")
                start = rng.randrange(len(pool))
                sents, n = [], 0
                while n < budget:
                    sent = pool[(start + len(sents)) % len(pool)].strip() + "."
                    n += len(tok.encode_batch([" " + sent])[0])
                    sents.append(sent)
                while sents and len(tok.encode_batch([" ".join(sents)])[0]) > budget:
                    sents.pop()
                at = round(len(sents) * depth / 100)
                text = " ".join(sents[:at] + [needle] + sents[at:]) + query
                items.append({"length": length, "depth": depth, "key": key, "value": value, "prompt": text})
    return items


def run(lm, items: list[dict], max_gen_toks: int = 12) -> dict:
    """Score items with a StemLM; returns {"cells": [...], "accuracy": overall percent, "n": ...}."""
    cells: dict = {}
    outputs = lm.generate_many([it["prompt"] for it in items], ["\n"], max_gen_toks)
    for it, out in zip(items, outputs):
        it["output"], it["correct"] = out, it["value"] in out
        cells.setdefault((it["length"], it["depth"]), []).append(it["correct"])
    rows = [{"length": L, "depth": d, "accuracy": 100.0 * sum(v) / len(v), "n": len(v)}
            for (L, d), v in sorted(cells.items())]
    n = len(items)
    return {"cells": rows, "accuracy": 100.0 * sum(it["correct"] for it in items) / max(n, 1), "n": n}
