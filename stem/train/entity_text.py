"""Calibration text about the entities the knowledge edits name (issue 41 item 3, docs/real.md): the dense model
writes, from short seeded prompts naming each entity of a facts file (reference/real/facts.yaml), a few tokens
each; the insertion's calibration (stem.train.calibration) reads these texts beside its source's windows, so the
STEM rows of the entities' tokens are the dense model's own activations at them. One job per dense checkpoint
(rule ``entity_text``, stem.layout.entity_text): the prompts, the seed, every text's token ids and words, the
token counts and the CPU seconds are recorded in its JSON, which the insertion job reads.

Sampling: temperature ``temperature`` over the whole vocabulary, one ``torch.Generator`` seeded ``seed``; the
prompts of one template are one batch (every entity here is one token, so they have the same length; prompts of
other lengths form their own batches) decoded with a KV cache.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import yaml

from stem.checkpoint import load_checkpoint
from stem.data.tokenizer import load_tokenizer
from stem.io import atomic_write_json
from stem.models.model import KVCache


def entity_names(facts) -> list[str]:
    """Every entity of the facts file ``facts`` (its ``kinds.*.entities``), in file order."""
    try:
        d = yaml.safe_load(Path(facts).read_text())
        names = [e for kind in d["kinds"].values() for e in kind["entities"]]
    except (OSError, yaml.YAMLError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"insert.calibration.entities.facts: {facts}: {type(e).__name__}: {e} (expected a facts "
                         f"file with kinds.<kind>.entities)") from None
    if not names:
        raise ValueError(f"insert.calibration.entities.facts: {facts}: no entities (expected kinds.<kind>.entities)")
    return names


@torch.no_grad()
def sample(model, prompts: torch.Tensor, new_tokens: int, temperature: float, gen: torch.Generator,
           eos_id: int | None = None) -> torch.Tensor:
    """``prompts`` (B, P) continued by ``new_tokens`` sampled tokens each (never ``eos_id``: every text runs its
    whole length): (B, P + new_tokens)."""
    cache, x, out = KVCache(), prompts, [prompts]
    for _ in range(new_tokens):
        logits = model(x, cache=cache)[:, -1].float() / temperature
        if eos_id is not None:
            logits[:, eos_id] = float("-inf")
        x = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
        out.append(x)
    return torch.cat(out, dim=1)


def generate(ckpt_dir, spec: dict, out) -> dict:
    """Write the entity texts of ``spec`` = {facts, prompts, new_tokens, samples, seed, temperature} written by the
    dense checkpoint ``ckpt_dir`` to ``out`` (JSON); returns the record."""
    t0 = time.process_time()
    names = entity_names(spec["facts"])
    bad = [p for p in spec["prompts"] if "{e}" not in p]
    if bad:
        raise ValueError(f"insert.calibration.entities.prompts: {bad[0]!r} has no {{e}} (expected the entity's place)")
    if not (Path(ckpt_dir) / "tokenizer.json").is_file():
        raise ValueError(f"checkpoint {ckpt_dir}: tokenizer.json is missing (not a finished checkpoint folder)")
    model = load_checkpoint(ckpt_dir, "cpu")[0].float().eval()
    tok = load_tokenizer(Path(ckpt_dir) / "tokenizer.json")
    gen = torch.Generator().manual_seed(int(spec["seed"]))
    texts = []
    for template in spec["prompts"]:
        groups: dict[int, list] = {}
        for name in names:
            ids = tok.encode_batch([template.format(e=name)])[0]
            groups.setdefault(len(ids), []).extend([(name, ids)] * int(spec["samples"]))
        for rows in groups.values():
            ids = sample(model, torch.tensor([r[1] for r in rows]), int(spec["new_tokens"]),
                         float(spec["temperature"]), gen, tok.eos_id)
            texts += [{"entity": n, "prompt": template.format(e=n), "prompt_tokens": len(p), "ids": i.tolist(),
                       "text": tok.decode(i.tolist())} for (n, p), i in zip(rows, ids)]
    rec = {"spec": spec, "checkpoint": str(ckpt_dir), "entities": len(names), "texts": texts,
           "entity_ids": {n: tok.encode_batch([" " + n])[0] for n in names},   # as the prompts write it
           "tokens": sum(len(t["ids"]) for t in texts), "generated_tokens": len(texts) * int(spec["new_tokens"]),
           "cpu_seconds": round(time.process_time() - t0, 1)}
    atomic_write_json(out, rec)
    return rec


def entity_windows(path) -> tuple[list[torch.Tensor], dict]:
    """The texts of an entity_text JSON as (B, T) tensors, one per text length, and its record without the
    texts."""
    try:
        d = json.loads(Path(path).read_text())
        by_len: dict[int, list] = {}
        for t in d["texts"]:
            by_len.setdefault(len(t["ids"]), []).append(t["ids"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"insert.calibration.entities: {path}: {type(e).__name__}: {e} (expected the entity_text "
                         f"job's JSON)") from None
    return [torch.tensor(v, dtype=torch.long) for v in by_len.values()], {k: v for k, v in d.items() if k != "texts"}
