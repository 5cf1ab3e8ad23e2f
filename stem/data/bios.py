"""The knowledge experiment's world: synthetic biographies whose information content is known by construction.

In the style of the bioS data of Allen-Zhu & Li ("Physics of Language Models, Part 3.3: Knowledge Capacity
Scaling Laws", 2024): a pool of ``names`` individuals, each with K attributes whose values are drawn uniformly
and independently from a set of known size, so a fact carries log2|set| bits. The world of size N is the pool's
first N individuals (the worlds are nested: one tokenizer serves every N). Names are one token each in the main
setting (``name_kind: one``: a unique word the tokenizer adds as a token, stem.data.tokenizer.add_words) or a
first and a last name drawn from two small pools in the control (``multi``: several BPE tokens, each shared by
many individuals, so no single token identifies an individual), or a first and a last name drawn from two pools of
``pair_pool`` words that the tokenizer adds as whole-word tokens (``pair``: exactly two tokens a name, each shared
by many individuals: the capacity sweep's names, whose facts must sit in weights of a fixed size).

A biography states every attribute once, each with a template drawn from the attribute's paraphrases, in a
fresh random order per exposure; the generator writes every individual of the world exactly ``exposures``
times (one document per biography). Everything is a pure function of the seeds. Torch-free.
"""
from __future__ import annotations

import json
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from functools import lru_cache

from stem.data.synth import _Namer
from stem.options import NameKind
from stem.registry import GENERATORS

SUFFIXES = {"city": ("ton", "burg", "vale", "port", "holm"), "university": ("ford", "wick", "mere"),
            "employer": ("corp", "works", "tek"), "major": ("logy", "nomy", "ics")}


@dataclass(frozen=True)
class Bios:
    """The pool of individuals: display names, each attribute's value set, each individual's value indices."""
    names: tuple[str, ...]
    attributes: tuple[str, ...]
    values: tuple[tuple[str, ...], ...]        # per attribute, its set (size = the config's)
    facts: tuple[tuple[int, ...], ...]         # per individual, per attribute: the value's index
    templates: tuple[tuple[str, ...], ...]     # per attribute, its paraphrases ("{name} ... {value}.")
    name_kind: str
    words: tuple[str, ...]                     # the words a tokenizer adds: one-token names, pair's pools (multi: none)

    def value(self, i: int, a: int) -> str:
        return self.values[a][self.facts[i][a]]

    def bits_per_individual(self) -> float:
        return sum(math.log2(len(v)) for v in self.values)


def template_problem(template: str) -> str | None:
    """The problem with one template (None: fine): both slots once, the value after a space, nothing else."""
    if template.count("{name}") != 1 or template.count("{value}") != 1:
        return f"{template!r}; expected exactly one {{name}} and one {{value}} slot"
    if " {value}" not in template:
        return f"{template!r}; expected a space before {{value}} (the value is scored as its own words)"
    rest = template.replace("{name}", "").replace("{value}", "")
    if "{" in rest or "}" in rest:
        return f"{template!r}; expected no slot but {{name}} and {{value}}"
    return None


def make_bios(spec: Mapping) -> Bios:
    """The pool from the config's ``knowledge:`` mapping (seed, names, name_kind, attributes, templates)."""
    return _make(json.dumps(dict(spec), sort_keys=True, default=str))


@lru_cache(maxsize=8)
def _make(key: str) -> Bios:
    spec = json.loads(key)
    rng = random.Random(f"bios:{spec['seed']}")
    namer = _Namer(rng, reserved=set())
    attrs = tuple(spec["attributes"])
    values = tuple(tuple(namer.word((2, 3), SUFFIXES.get(a, ("",)), max_len=12) for _ in range(int(spec["attributes"][a])))
                   for a in attrs)
    n, kind = int(spec["names"]), spec.get("name_kind", NameKind.ONE)
    if kind in (NameKind.ONE, NameKind.PAIR):
        words = tuple(namer.word((2, 3), max_len=12) for _ in range(n))
        names = words
    if kind == NameKind.PAIR:   # after the one-token names (so no pool word is one), the same facts
        names, words = _pairs(rng, namer, n, int(spec.get("pair_pool") or pair_pool(n)))
    elif kind == NameKind.MULTI:   # the pools' words are not added: several BPE tokens each
        names, words = _pairs(rng, namer, n, pair_pool(n))[0], ()
    facts_rng = random.Random(f"bios-facts:{spec['seed']}")   # the same facts whatever the names' kind
    facts = tuple(tuple(facts_rng.randrange(len(v)) for v in values) for _ in range(n))
    templates = tuple(tuple(spec["templates"][a]) for a in attrs)
    return Bios(names, attrs, values, facts, templates, kind, words)


def name_words(spec: Mapping) -> tuple[str, ...]:
    """The words a tokenizer adds for the pool (``Bios.words``): with one-token names only the first
    ``name_tokens`` of them where the spec sets it (the rest of the pool is named by pairs only)."""
    bios = make_bios({k: v for k, v in spec.items() if k != "name_tokens"})
    k = spec.get("name_tokens")
    return bios.words[:k] if k and bios.name_kind == NameKind.ONE else bios.words


def pair_pool(names: int) -> int:
    """The default size of each of pair's two pools (the multi control's): ceil(sqrt(names)) + 2."""
    return max(2, math.ceil(math.sqrt(names)) + 2)


def _pairs(rng: random.Random, namer, n: int, side: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """n distinct (first, last) names from two pools of ``side`` whole words each, and the pools' words."""
    if side * side < n:
        raise ValueError(f"bios: pair_pool = {side} words a side gives {side * side} names; expected at least "
                         f"knowledge.names ({n})")
    first = [namer.word((1, 2)) for _ in range(side)]
    last = [namer.word((2, 3)) for _ in range(side)]
    pairs = [(f, s) for f in range(side) for s in range(side)]
    rng.shuffle(pairs)
    return tuple(f"{first[f]} {last[s]}" for f, s in pairs[:n]), tuple(first + last)


def biography(rng: random.Random, bios: Bios, i: int) -> str:
    """Individual ``i``'s biography: every attribute once, a random paraphrase each, in a random order."""
    order = list(range(len(bios.attributes)))
    rng.shuffle(order)
    return " ".join(rng.choice(bios.templates[a]).format(name=bios.names[i], value=bios.value(i, a)) for a in order)


def bios_documents(world, seed: int = 0, *, knowledge: Mapping, n: int, exposures: int,
                   name_kind: str | None = None) -> Iterator[str]:
    """Generator ``bios``: the first ``n`` individuals, each exactly ``exposures`` times (a fresh order of the
    individuals and of each biography's attributes per exposure). ``world`` (the web world) is not used;
    ``name_kind`` (a source's own) overrides the knowledge section's."""
    spec = {**knowledge, **({"name_kind": name_kind} if name_kind else {})}
    bios = make_bios(spec)
    if not 1 <= n <= len(bios.names):
        raise ValueError(f"bios: n = {n} individuals; expected 1 <= n <= knowledge.names ({len(bios.names)})")
    rng = random.Random(f"bios-docs:{seed}:{n}:{bios.name_kind}")
    for _ in range(int(exposures)):
        people = list(range(n))
        rng.shuffle(people)
        for i in people:
            yield biography(rng, bios, i)


GENERATORS.add("bios", bios_documents)
