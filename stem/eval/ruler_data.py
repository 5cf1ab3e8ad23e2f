"""The RULER stand-in of the offline fixtures: lm-eval's 13 ``ruler`` tasks (NIAH single 1-3, multi-key 1-3,
multi-value, multi-query; variable tracking; common and frequent words extraction; QA on SQuAD and HotpotQA) on
items generated here in their dataset's schema ({index, input, outputs, length, max_length, gen_prefix}) and
scored by lm-eval's own RULER code (``common_utils.process_results``: every expected string in the output).

lm-eval generates RULER's items itself at load time (``lm_eval/tasks/ruler/*_utils.py``), from the Paul Graham
essays, wonderwords' word lists and SQuAD / HotpotQA downloads, sized to each length with the model's tokenizer.
Here, offline: the same prompt templates and needle formats, sized the same way with the scale's tokenizer; the
essay haystack is the synthetic world's prose, RULER's word keys are pairs of the world's filler words, and the
two QA tasks ask the world's facts from passages about its countries and people (one gold passage for SQuAD's
stand-in, two hops for HotpotQA's) among distractor passages. Variable tracking has no in-context example (RULER
adds one; the tiny context has no room). docs/evaluation.md
"""
from __future__ import annotations

import random
import string
import uuid

from stem.data import synth
from stem.data.synth import World

NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
                 "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
                 "{type_needle_v} for {query} mentioned in the provided text?")
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
REPEAT = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
# task -> (haystack, key type, value type, keys, values per key, queries): lm-eval's niah_utils.py
NIAH = {"niah_single_1": ("repeat", "words", "numbers", 1, 1, 1),
        "niah_single_2": ("essay", "words", "numbers", 1, 1, 1),
        "niah_single_3": ("essay", "words", "uuids", 1, 1, 1),
        "niah_multikey_1": ("essay", "words", "numbers", 4, 1, 1),
        "niah_multikey_2": ("needle", "words", "numbers", 1, 1, 1),
        "niah_multikey_3": ("needle", "uuids", "uuids", 1, 1, 1),
        "niah_multivalue": ("essay", "words", "numbers", 1, 4, 1),
        "niah_multiquery": ("essay", "words", "numbers", 4, 1, 4)}
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_PREFIX = ("Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
             "assgined the value {query}, they are:")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
                "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above "
                "list?")
CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = "Answer: According to the coded text above, the three most frequently appeared words are:"
QA_TEMPLATE = ("Answer the question based on the given documents. Only give me the answer and do not output any "
               "other words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the "
               "given documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}")
TASKS = (*NIAH, "ruler_vt", "ruler_cwe", "ruler_fwe", "ruler_qa_squad", "ruler_qa_hotpot")


def _value(rng: random.Random, w: World, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return "-".join(rng.sample(w.filler[50:], 2))   # words: RULER's adjective-noun pairs


def _niah(rng: random.Random, w: World, task: str, length: int):
    hay, kk, kv, n_k, n_v, n_q = NIAH[task]
    keys = [_value(rng, w, kk) for _ in range(n_k)]
    values = [[_value(rng, w, kv) for _ in range(n_v)] for _ in keys]
    needles = [NEEDLE.format(type_needle_v=kv, key=k, value=v) for k, vs in zip(keys, values) for v in vs]
    rng.shuffle(needles)
    depths = sorted(rng.random() for _ in needles)
    asked = rng.sample(range(n_k), n_q)
    query = ", ".join(keys[i] for i in asked[:-1]) + ", and " + keys[asked[-1]] if n_q > 1 else keys[asked[0]]
    kind, template, prefix = kv, NIAH_TEMPLATE, "are"
    if n_q * n_v == 1:   # RULER's singular wording
        kind = kv[:-1]
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        prefix = "is"
    if hay == "essay":   # at least `length` words of prose: more than fits
        sents = synth.long_documents(w, rng.randrange(10**9), 2000, 8000)
        pool = " ".join(next(sents) for _ in range(max(12, length // 200))).replace("\n", " ").split(". ")
        unit = [s.strip() + "." for s in pool if s.strip()]
    elif hay == "needle":   # every unit is at least a token: `length` of them is more than fits
        unit = [NEEDLE.format(type_needle_v=kv, key=_value(rng, w, kk), value=_value(rng, w, kv)) for _ in range(length)]
    else:
        unit = [REPEAT] * length
    sep = " " if hay == "essay" else "\n"

    def build(n: int):
        body = list(unit[:n])
        for d, needle in zip(reversed(depths), reversed(needles)):   # deepest first keeps earlier positions
            body.insert(round(d * len(body)), needle)
        text = template.format(type_needle_v=kind if n_q * n_v == 1 else kv, context=sep.join(body), query=query)
        return text, [v for i in asked for v in values[i]], \
            f"The special magic {kind if n_q * n_v == 1 else kv} for {query} mentioned in the provided text {prefix}"
    return build, len(unit)


def _vt(rng: random.Random, w: World, task: str, length: int):
    names = {}   # distinct names in the order drawn (a set's order depends on PYTHONHASHSEED: not reproducible)
    while len(names) < 5:
        names["".join(rng.choices(string.ascii_uppercase, k=5))] = None
    names = list(names)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(4)]
    where = sorted(rng.random() for _ in chain)

    def build(n: int):
        body = [REPEAT] * n
        for d, link in zip(reversed(where), reversed(chain)):
            body.insert(round(d * len(body)), link)
        return VT_TEMPLATE.format(context="\n".join(body), query=value), names, \
            VT_PREFIX.format(num_v=len(names), query=value)
    return build, length


def _cwe(rng: random.Random, w: World, task: str, length: int):
    words = rng.sample(w.filler[50:], len(w.filler) - 50)

    def build(n: int):   # RULER below 4k tokens: the 10 common words 6 times, the others once
        common, rare = words[:10], words[10:10 + n]
        listed = common * 6 + rare
        random.Random(len(listed)).shuffle(listed)
        return CWE_TEMPLATE.format(context=" ".join(f"{k + 1}. {x}" for k, x in enumerate(listed))), common, CWE_PREFIX
    return build, len(words) - 10


def _fwe(rng: random.Random, w: World, task: str, length: int):
    vocab = sorted({"".join(rng.choices(string.ascii_lowercase, k=6)) for _ in range(max(length // 50, 8))})
    rng.shuffle(vocab)
    vocab[0] = "..."   # RULER: the top-ranked word is noise

    def build(n: int):   # Zipf counts (alpha 2) over the vocabulary, n words in all
        counts = [int(n / (k * k) / 1.6449) for k in range(1, len(vocab) + 1)]
        coded = [x for x, c in zip(vocab, counts) for _ in range(c)]
        random.Random(n).shuffle(coded)
        return FWE_TEMPLATE.format(context=" ".join(coded)), vocab[1:4], FWE_PREFIX
    return build, 20 * length


def _qa(rng: random.Random, w: World, task: str, length: int):
    if task == "ruler_qa_squad":   # one gold passage: a country's facts
        c = rng.choice(w.countries)
        gold = [" ".join(synth.country_sentences(rng, c))]
        query, answer = f"What is the capital of {c.name}?", c.capital
        others = [x for x in w.countries if x is not c]
    else:                          # two hops: a person's home city, then that city's country
        p = rng.choice(w.people)
        c = next(x for x in w.countries if x.name == p.country)
        gold = [" ".join(synth.bio_sentences(rng, p)),
                f"{p.city} is a city in {c.name}. " + " ".join(synth.country_sentences(rng, c))]
        query, answer = f"In which country did {p.name} live?", c.name
        others = [x for x in w.countries if x is not c]
    distract = [" ".join(synth.country_sentences(rng, x)) for x in rng.sample(others, len(others))]
    distract += [" ".join(synth.bio_sentences(rng, x)) for x in w.people if x.name not in query]

    def build(n: int):
        docs = gold + distract[:n]
        random.Random(n).shuffle(docs)
        context = "\n\n".join(f"Document {k + 1}:\n{d}" for k, d in enumerate(docs))
        return QA_TEMPLATE.format(context=context, query=query), [answer], "Answer:"
    return build, len(distract)


def make_doc(rng: random.Random, w: World, i: int, task: str, tok, length: int, gen: int) -> dict:
    """One item of ``task`` whose prompt (input, a newline and gen_prefix) plus ``gen`` generated tokens fits
    ``length`` tokens of ``tok``, with as much haystack as fits (the most units, found by bisection; CWE and QA as
    much as the world has: its filler words, its countries' and people's passages)."""
    family = {"ruler_vt": _vt, "ruler_cwe": _cwe, "ruler_fwe": _fwe, "ruler_qa_squad": _qa, "ruler_qa_hotpot": _qa}
    build, most = (_niah if task in NIAH else family[task])(rng, w, task, length)

    def size(n):
        text, _, prefix = build(n)
        return len(tok.encode_batch([f"{text}\n{prefix}"])[0]) + gen

    lo, hi = 0, most
    if size(lo) > length:
        raise ValueError(f"ruler fixture {task}: length {length} leaves no room for the prompt and {gen} generated "
                         "tokens")
    while lo < hi:   # the largest n with size(n) <= length
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if size(mid) <= length else (lo, mid - 1)
    text, outputs, prefix = build(lo)
    return {"index": i, "input": text, "outputs": outputs, "length": size(lo), "max_length": length,
            "gen_prefix": prefix}
