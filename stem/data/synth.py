"""Deterministic synthetic world and corpora for the embedded (CPU-sized) default.

A :class:`World` is a small set of fictional countries (capital, other cities,
continent, language, population) and people (birth year, city, profession),
plus a syllable-generated filler vocabulary sampled with a Zipf law.  Document
generators turn a world into endless streams of text:

* ``web``  - prose stating world facts with varied templates, biographies,
  quizzes and Zipfian filler sentences;
* ``math`` - arithmetic drills and GSM8K-style word problems ending in
  ``#### <answer>``;
* ``code`` - small executable Python snippets over the world's data;
* ``long`` - multi-section texts whose length lies in ``[min_chars, max_chars]``.

Everything is a pure function of explicit seeds (``random.Random`` instances,
never the global RNG), so ``write_jsonl`` output is byte-identical across runs.
Every fact stated in a document agrees with the world, every equation in a math
or code document is correct.

CLI: ``python -m stem.data.synth --kind web --bytes 100000 --seed 0 --out x.jsonl``
"""
from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import os
import random
import re
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterator

from stem.io import atomic_open
from stem.registry import GENERATORS

# ----------------------------------------------------------------- the world


@dataclass(frozen=True)
class Country:
    name: str
    capital: str
    continent: str
    language: str
    population_millions: int
    cities: tuple[str, ...] = ()  # capital first, then the other cities


@dataclass(frozen=True)
class Person:
    name: str
    birth_year: int
    city: str
    country: str
    profession: str


@dataclass(frozen=True)
class World:
    """All facts of the synthetic world; lookups (``country``, ``person``, ...) are cached."""

    seed: int
    countries: tuple[Country, ...]
    people: tuple[Person, ...]
    filler: tuple[str, ...]  # ordered by rank: filler[0] is the most frequent word

    @cached_property
    def _countries(self) -> dict[str, Country]:
        return {c.name: c for c in self.countries}

    @cached_property
    def _people(self) -> dict[str, Person]:
        return {p.name: p for p in self.people}

    @cached_property
    def _city_country(self) -> dict[str, str]:
        return {city: c.name for c in self.countries for city in c.cities}

    @cached_property
    def filler_cum_weights(self) -> tuple[float, ...]:
        return _zipf_cum_weights(len(self.filler))

    def country(self, name: str) -> Country:
        return self._countries[name]

    def person(self, name: str) -> Person:
        return self._people[name]

    def city_country(self, city: str) -> str:
        return self._city_country[city]

    @property
    def continents(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.continent for c in self.countries))

    @property
    def languages(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(c.language for c in self.countries))

    def countries_in(self, continent: str) -> tuple[Country, ...]:
        return tuple(c for c in self.countries if c.continent == continent)

    def people_in(self, country: str) -> tuple[Person, ...]:
        return self._people_by_country.get(country, ())

    @cached_property
    def _people_by_country(self) -> dict[str, tuple[Person, ...]]:
        out: dict[str, list[Person]] = {}
        for p in self.people:
            out.setdefault(p.country, []).append(p)
        return {k: tuple(v) for k, v in out.items()}


PROFESSIONS = (
    "farmer", "teacher", "baker", "sailor", "painter", "engineer", "doctor", "weaver",
    "poet", "merchant", "carpenter", "astronomer", "architect", "musician", "miner",
    "judge", "inventor", "librarian", "potter", "mapmaker",
)
FUNCTION_WORDS = (
    "the", "the", "the", "of", "of", "and", "and", "to", "a", "in", "in", "is", "was",
    "it", "that", "for", "on", "with", "as", "by", "at", "from", "this", "but", "or",
    "not", "are", "were", "all", "some", "many", "when", "which", "there", "their",
    "its", "into", "over", "after", "before", "very", "more",
)
_ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z",
           "br", "dr", "gr", "kr", "tr", "st", "th", "sh", "ch", "sk")
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ia", "ou", "ei")
_CODAS = ("n", "r", "l", "s", "m", "th", "nd", "rk", "st", "x")


def _zipf_cum_weights(n: int, exponent: float = 1.1) -> tuple[float, ...]:
    total, cum = 0.0, []
    for rank in range(1, n + 1):
        total += 1.0 / rank ** exponent
        cum.append(total)
    return tuple(cum)


class _Namer:
    """Pronounceable, globally unique words built from syllables."""

    def __init__(self, rng: random.Random, reserved: set[str]):
        self.rng, self.used = rng, set(reserved)

    def word(self, syllables: tuple[int, int], suffixes: tuple[str, ...] = ("",),
             capitalize: bool = True, max_len: int = 10) -> str:
        rng = self.rng
        for attempt in range(1000):
            n = rng.randint(*syllables) + attempt // 200  # lengthen if the space is crowded
            parts = [("" if i == 0 and rng.random() < 0.15 else rng.choice(_ONSETS))
                     + rng.choice(_VOWELS) for i in range(n)]
            if rng.random() < 0.5:
                parts.append(rng.choice(_CODAS))
            stem, suffix = "".join(parts), rng.choice(suffixes)
            if suffix and suffix[0] in "aeiou" and stem[-1] in "aeiou":
                stem = stem[:-1]
            w = stem + suffix
            if w not in self.used and (len(w) <= max_len or attempt >= 500):
                self.used.add(w)
                return w.capitalize() if capitalize else w
        raise RuntimeError("name space exhausted")


def make_world(seed: int = 0, n_countries: int = 40, n_people: int = 200,
               n_filler: int = 2000) -> World:
    if n_countries < 2 or n_people < 2 or n_filler < 1:
        raise ValueError("need n_countries >= 2, n_people >= 2, n_filler >= 1")
    rng = random.Random(f"world:{seed}")
    namer = _Namer(rng, _RESERVED_WORDS)
    continents = [namer.word((2, 3), ("ia", "a", "ica")) for _ in range(min(6, max(1, n_countries // 5)))]
    languages = [namer.word((2, 2), ("ese", "ic", "ish", "ian", "i")) for _ in range(max(1, 2 * n_countries // 3))]
    countries = []
    for i in range(n_countries):
        name = namer.word((2, 3), ("", "", "ia", "land", "stan", "a"))
        cities = tuple(namer.word((2, 3), ("", "", "burg", "ton", "grad", "polis", "mar", "vik"))
                       for _ in range(1 + rng.randint(1, 3)))
        continent = continents[i] if i < len(continents) else rng.choice(continents)
        language = languages[i] if i < len(languages) else rng.choice(languages)
        population = max(1, min(400, int(rng.lognormvariate(3.0, 1.0))))
        countries.append(Country(name, cities[0], continent, language, population, cities))
    people = []
    for _ in range(n_people):
        first = namer.word((2, 2), ("", "", "a", "o"))
        last = namer.word((2, 3), ("", "", "son", "ski", "ez", "ov", "er"))
        c = rng.choice(countries)
        people.append(Person(f"{first} {last}", rng.randint(1720, 1995), rng.choice(c.cities),
                             c.name, rng.choice(PROFESSIONS)))
    # Frequent filler words are short, rare ones long (as in natural language).
    filler = tuple(namer.word((1, 1) if r < 60 else (2, 2) if r < 600 else (2, 3), capitalize=False)
                   for r in range(n_filler))
    return World(seed, tuple(countries), tuple(people), filler)


# ------------------------------------------------------------- web templates

CAPITAL_T = (
    "The capital of {c} is {cap}.",
    "{cap} is the capital of {c}.",
    "{cap}, the capital city of {c}, is home to the national government.",
    "{c}'s capital is {cap}.",
    "The government of {c} meets in {cap}, the capital.",
    "The capital city of {c} is {cap}.",
    "Most visitors to {c} arrive first in its capital, {cap}.",
)
CONTINENT_T = (
    "{c} is a country in {cont}.",
    "{c} lies in {cont}.",
    "{c} is one of the countries of {cont}.",
    "Geographically, {c} belongs to {cont}.",
    "On the continent of {cont} lies the country of {c}.",
    "{c} is located in {cont}.",
)
LANGUAGE_T = (
    "The people of {c} speak {lang}.",
    "{lang} is the official language of {c}.",
    "In {c}, most people speak {lang}.",
    "The main language of {c} is {lang}.",
    "{c}'s official language is {lang}.",
    "Visitors to {c} hear {lang} spoken in every town.",
)
CONT_LANG_T = (
    "{c} is a country in {cont} whose people speak {lang}.",
    "Located in {cont}, {c} is a country where {lang} is spoken.",
    "{c}, a {lang}-speaking country, lies in {cont}.",
    "In {cont} lies {c}, where people speak {lang}.",
    "{c} is a {lang}-speaking nation in {cont}.",
    "The {lang}-speaking country of {c} is part of {cont}.",
)
POPULATION_T = (
    "{c} has a population of about {pop} million people.",
    "About {pop} million people live in {c}.",
    "The population of {c} is roughly {pop} million.",
    "With {pop} million inhabitants, {c} is {size} country.",
    "{c} is home to around {pop} million people.",
    "Roughly {pop} million people call {c} home.",
)
CITY_T = (
    "{city} is a city in {c}.",
    "The city of {city} lies in {c}.",
    "{city} is one of the cities of {c}.",
    "Besides {cap}, {c} has other cities such as {city}.",
    "Travelers in {c} often visit {city}.",
    "{city} is located in {c}.",
)
BIRTH_T = (
    "{name} was born in {year}.",
    "{name} was born in the year {year}.",
    "In {year}, {name} was born.",
    "{name} came into the world in {year}.",
    "The birth year of {name} is {year}.",
    "{name}'s life began in {year}.",
)
HOME_T = (
    "{name} lived in {city}, a city in {country}.",
    "{name} spent most of a long life in {city}.",
    "{name} made a home in {city}, {country}.",
    "{name} lived and worked in the city of {city}.",
    "The city of {city} in {country} was home to {name}.",
    "{name} was a resident of {city}.",
)
PROFESSION_T = (
    "{name} worked as {a_prof}.",
    "{name} was {a_prof} by trade.",
    "{name} earned a living as {a_prof}.",
    "As {a_prof}, {name} became well known in {city}.",
    "{name} is remembered as {a_prof}.",
    "By profession, {name} was {a_prof}.",
)
BIO_T = (
    "{name} was born in {year} and worked as {a_prof} in {city}.",
    "{name} (born {year}) was {a_prof} from {city}, {country}.",
    "Born in {year}, {name} became {a_prof} in {city}.",
    "{name}, born in {year}, was {a_prof} who lived in {city}.",
    "The {prof} {name} was born in {year} and lived in {city}, {country}.",
    "{name} was {a_prof} from {country}, born in {year}.",
)
QUIZ_T = (
    ("What is the capital of {c}?", "{cap}"),
    ("Which continent is {c} in?", "{cont}"),
    ("What language do people speak in {c}?", "{lang}"),
    ("About how many million people live in {c}?", "{pop}"),
    ("In which country is the city of {city}?", "{c}"),
)
PERSON_QUIZ_T = (
    ("In what year was {name} born?", "{year}"),
    ("What was the profession of {name}?", "{a_prof}"),
    ("In which city did {name} live?", "{city}"),
)
_ALL_TEMPLATES = (CAPITAL_T + CONTINENT_T + LANGUAGE_T + CONT_LANG_T + POPULATION_T + CITY_T
                  + BIRTH_T + HOME_T + PROFESSION_T + BIO_T
                  + tuple(q + " " + a for q, a in QUIZ_T + PERSON_QUIZ_T))
# Generated names never coincide with an English word used by the templates.
_RESERVED_WORDS = frozenset(w.lower() for w in re.findall(r"[A-Za-z]+", " ".join(
    _ALL_TEMPLATES + PROFESSIONS + FUNCTION_WORDS + ("large", "small", "mid", "sized", "an"))))


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _country_vars(rng: random.Random, c: Country) -> dict[str, object]:
    size = "a small" if c.population_millions < 10 else "a large" if c.population_millions >= 60 else "a mid-sized"
    return {"c": c.name, "cap": c.capital, "cont": c.continent, "lang": c.language,
            "pop": c.population_millions, "size": size,
            "city": rng.choice(c.cities[1:] or c.cities)}


def _person_vars(p: Person) -> dict[str, object]:
    return {"name": p.name, "year": p.birth_year, "city": p.city, "country": p.country,
            "prof": p.profession, "a_prof": article(p.profession)}


def country_sentences(rng: random.Random, c: Country) -> list[str]:
    v = _country_vars(rng, c)
    groups = [CAPITAL_T, POPULATION_T] + ([CONT_LANG_T] if rng.random() < 0.3 else [CONTINENT_T, LANGUAGE_T])
    if len(c.cities) > 1:
        groups.append(CITY_T)
    rng.shuffle(groups)
    return [rng.choice(g).format(**v) for g in groups[:rng.randint(2, len(groups))]]


def bio_sentences(rng: random.Random, p: Person) -> list[str]:
    v = _person_vars(p)
    groups = [BIO_T] if rng.random() < 0.3 else [BIRTH_T, HOME_T, PROFESSION_T]
    rng.shuffle(groups)
    out = []
    for i, g in enumerate(groups):
        out.append(rng.choice(g).format(**v))
        if i == 0 and rng.random() < 0.6:  # refer to people by surname after the first mention
            v["name"] = p.name.split()[-1]
    return out


def _filler_sentence(rng: random.Random, world: World) -> str:
    cum, words, total = world.filler_cum_weights, world.filler, world.filler_cum_weights[-1]
    toks = []
    for i in range(rng.randint(5, 15)):
        if rng.random() < 0.4:
            toks.append(rng.choice(FUNCTION_WORDS))
        else:
            toks.append(words[min(bisect.bisect_right(cum, rng.random() * total), len(words) - 1)])
        if i > 2 and rng.random() < 0.06:
            toks[-1] += ","
    s = " ".join(toks).rstrip(",")
    return s[0].upper() + s[1:] + "."


def _paragraph(rng: random.Random, world: World, facts: list[str], filler_rate: float) -> str:
    out = []
    for s in facts:
        while rng.random() < filler_rate:
            out.append(_filler_sentence(rng, world))
        out.append(s)
    return " ".join(out)


def _web_document(rng: random.Random, world: World) -> str:
    kind = rng.choices(("country", "bio", "continent", "quiz", "essay"), (35, 25, 12, 8, 20))[0]
    fr = rng.choice((0.0, 0.15, 0.3))
    if kind == "country":
        c = rng.choice(world.countries)
        paras = [_paragraph(rng, world, country_sentences(rng, c), fr)]
        for p in rng.sample(world.people_in(c.name), min(rng.randint(0, 2), len(world.people_in(c.name)))):
            paras.append(_paragraph(rng, world, bio_sentences(rng, p), fr))
    elif kind == "bio":
        p = rng.choice(world.people)
        paras = [_paragraph(rng, world, bio_sentences(rng, p), fr)]
        if rng.random() < 0.6:
            paras.append(_paragraph(rng, world, country_sentences(rng, world.country(p.country)), fr))
    elif kind == "continent":
        cont = rng.choice(world.continents)
        cs = rng.sample(world.countries_in(cont), min(rng.randint(2, 4), len(world.countries_in(cont))))
        names = [c.name for c in cs]
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        paras = [f"Countries in {cont} include {listed}."]
        paras += [_paragraph(rng, world, country_sentences(rng, c), fr) for c in cs]
    elif kind == "quiz":
        lines = []
        for _ in range(rng.randint(3, 8)):
            if rng.random() < 0.7:
                c = rng.choice(world.countries)
                q, a = rng.choice(QUIZ_T if len(c.cities) > 1 else QUIZ_T[:4])
                v = _country_vars(rng, c)
            else:
                q, a = rng.choice(PERSON_QUIZ_T)
                v = _person_vars(rng.choice(world.people))
            lines.append(f"Q: {q.format(**v)}\nA: {a.format(**v)}")
        paras = lines
    else:  # essay: mostly filler, the occasional fact
        paras = []
        for _ in range(rng.randint(1, 4)):
            sents = [_filler_sentence(rng, world) for _ in range(rng.randint(2, 6))]
            if rng.random() < 0.5:
                sents.insert(rng.randint(0, len(sents)),
                             rng.choice(country_sentences(rng, rng.choice(world.countries))))
            paras.append(" ".join(sents))
    return "\n\n".join(paras)


def _doc_rng(kind: str, world: World, seed: int) -> random.Random:
    return random.Random(f"{kind}:{world.seed}:{seed}")


def web_documents(world: World, seed: int = 0) -> Iterator[str]:
    rng = _doc_rng("web", world, seed)
    while True:
        yield _web_document(rng, world)


# ---------------------------------------------------------------------- math

_OPS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "+": ("plus", lambda a, b: a + b), "-": ("minus", lambda a, b: a - b),
    "*": ("times", lambda a, b: a * b), "/": ("divided by", lambda a, b: a // b),
}
GOODS = ("apples", "books", "pencils", "loaves of bread", "jars of honey", "lanterns", "baskets of fish")


def _eq(a: int, op: str, b: int) -> tuple[str, int]:
    c = _OPS[op][1](a, b)
    return f"{a} {op} {b} = {c}", c


def _drill(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(4, 10)):
        op = rng.choice("+-*/")
        a, b = rng.randint(0, 99), rng.randint(1, 12 if op in "*/" else 99)
        if op == "-":
            a, b = max(a, b), min(a, b)
        if op == "/":
            a *= b
        eq, c = _eq(a, op, b)
        word = _OPS[op][0]
        lines.append(rng.choice((f"{eq}", f"{a} {word} {b} equals {c}.", f"What is {a} {word} {b}? {eq}.")))
    return "\n".join(lines)


# The word-problem templates, one function each: (question, solution steps, answer) about person ``p``.
def _market(rng: random.Random, world: World, p: Person) -> tuple[str, list[str], int]:
    first = p.name.split()[0]
    n, price, goods = rng.randint(2, 9), rng.randint(2, 20), rng.choice(GOODS)
    s1, total = _eq(n, "*", price)
    bill = (total // 10 + rng.randint(1, 5)) * 10
    s2, change = _eq(bill, "-", total)
    q = (f"{p.name} goes to the market in {p.city} and buys {n} {goods} that cost {price} coins each. "
         f"{first} pays with {bill} coins. How many coins does {first} get back as change?")
    return q, [f"The {goods} cost {s1} coins.", f"The change is {s2} coins."], change


def _populations(rng: random.Random, world: World, p: Person) -> tuple[str, list[str], int]:
    a, b = rng.sample(world.countries, 2)
    q = (f"{a.name} has {a.population_millions} million people and {b.name} has "
         f"{b.population_millions} million people. ")
    if rng.random() < 0.5 or a.population_millions == b.population_millions:
        s, ans = _eq(a.population_millions, "+", b.population_millions)
        return q + "How many million people live in the two countries together?", [f"Together they have {s} million people."], ans
    big, small = sorted((a, b), key=lambda c: -c.population_millions)
    s, ans = _eq(big.population_millions, "-", small.population_millions)
    return (q + "How many million more people live in the larger country?",
            [f"{big.name} is larger, with {s} million more people."], ans)


def _ages(rng: random.Random, world: World, p: Person) -> tuple[str, list[str], int]:
    first = p.name.split()[0]
    other = rng.choice([o for o in world.people if o.birth_year != p.birth_year] or [p])
    if other is p or rng.random() < 0.5:
        year = p.birth_year + rng.randint(10, 80)
        s, ans = _eq(year, "-", p.birth_year)
        return f"{p.name} was born in {p.birth_year}. How old did {first} turn in {year}?", [f"{first} turned {s} years old."], ans
    late, early = sorted((p, other), key=lambda x: -x.birth_year)
    s, ans = _eq(late.birth_year, "-", early.birth_year)
    return (f"{p.name} was born in {p.birth_year} and {other.name} was born in {other.birth_year}. "
            "How many years apart were they born?", [f"They were born {s} years apart."], ans)


def _train_trip(rng: random.Random, world: World, p: Person) -> tuple[str, list[str], int]:
    speed, hours = rng.randint(3, 12) * 5, rng.randint(2, 9)
    s1, d = _eq(speed, "*", hours)
    s2, total = _eq(d, "*", 2)
    q = (f"A train from {p.city} travels at {speed} kilometers per hour for {hours} hours, then makes "
         "the same trip back at the same speed. How many kilometers does it travel in total?")
    return q, [f"One way is {s1} kilometers.", f"There and back is {s2} kilometers."], total


def _bread(rng: random.Random, world: World, p: Person) -> tuple[str, list[str], int]:
    k, each, give = rng.randint(2, 9), rng.randint(4, 15), rng.randint(1, 3)
    s1, q1 = _eq(k * each, "/", k)
    s2, keep = _eq(q1, "-", give)
    q = (f"{p.name} bakes {k * each} loaves of bread and shares them equally among {k} families in "
         f"{p.city}. Each family gives {give} loaves to its neighbors. How many loaves does each family keep?")
    return q, [f"Each family gets {s1} loaves.", f"Each family keeps {s2} loaves."], keep


def _sheep(rng: random.Random, world: World, p: Person) -> tuple[str, list[str], int]:
    start, per_week, weeks = rng.randint(5, 60), rng.randint(2, 12), rng.randint(2, 8)
    s1, bought = _eq(per_week, "*", weeks)
    s2, have = _eq(start, "+", bought)
    sold = rng.randint(1, have)
    s3, left = _eq(have, "-", sold)
    q = (f"A farmer near {p.city} has {start} sheep and buys {per_week} more sheep every week. After "
         f"{weeks} weeks the farmer sells {sold} sheep. How many sheep does the farmer have now?")
    return q, [f"The farmer buys {s1} sheep.", f"Then the farmer has {s2} sheep.", f"After selling, {s3} sheep are left."], left


def _wages(rng: random.Random, world: World, p: Person) -> tuple[str, list[str], int]:
    first, v = p.name.split()[0], _person_vars(p)
    hours, rate, days = rng.randint(2, 10), rng.randint(3, 25), rng.randint(2, 7)
    s1, daily = _eq(hours, "*", rate)
    s2, total = _eq(daily, "*", days)
    q = (f"{p.name} is {v['a_prof']} in {p.city} who works {hours} hours a day and earns {rate} coins per "
         f"hour. How many coins does {first} earn in {days} days?")
    return q, [f"Each day {first} earns {s1} coins.", f"In {days} days that is {s2} coins."], total


_WORD_PROBLEMS = (_market, _populations, _ages, _train_trip, _bread, _sheep, _wages)


def word_problem(rng: random.Random, world: World) -> tuple[str, list[str], int]:
    """A grade-school word problem about a person of ``world``: (question, solution steps, answer)."""
    p = rng.choice(world.people)
    return _WORD_PROBLEMS[rng.randrange(len(_WORD_PROBLEMS))](rng, world, p)


def math_documents(world: World, seed: int = 0) -> Iterator[str]:
    rng = _doc_rng("math", world, seed)
    while True:
        if rng.random() < 0.35:
            yield _drill(rng)
        else:
            q, steps, ans = word_problem(rng, world)
            yield f"Question: {q}\nAnswer: " + "\n".join(steps) + f"\n#### {ans}"


# ---------------------------------------------------------------------- code

_FUNCS = (  # name, parameters, docstring, body
    ("area", "width, height", "Return the area of a rectangle.", "return width * height"),
    ("perimeter", "width, height", "Return the perimeter of a rectangle.", "return 2 * (width + height)"),
    ("total_cost", "price, quantity", "Return the cost of buying several items.", "return price * quantity"),
    ("to_minutes", "hours", "Return the number of minutes in some hours.", "return hours * 60"),
    ("sum_to", "n", "Return 1 + 2 + ... + n.", "total = 0\nfor i in range(1, n + 1):\n    total += i\nreturn total"),
    ("factorial", "n", "Return n factorial.", "result = 1\nfor i in range(2, n + 1):\n    result *= i\nreturn result"),
    ("fib", "n", "Return the n-th Fibonacci number.", "a, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nreturn a"),
)


def _dict_literal(var: str, items: list[tuple[str, object]]) -> str:
    return f"{var} = {{\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in items) + "}"


def _code_document(rng: random.Random, world: World) -> str:
    kind = rng.randrange(5)
    cs = rng.sample(world.countries, min(rng.randint(3, 8), len(world.countries)))
    if kind == 0:
        fn, var = rng.choice(("capital_of", "get_capital", "lookup_capital")), rng.choice(("CAPITALS", "capitals"))
        a, b = rng.sample(cs, 2)
        return (_dict_literal(var, [(c.name, c.capital) for c in cs]) + f"\n\n\ndef {fn}(country):\n"
                f'    """Return the capital city of a country."""\n    return {var}[country]\n\n\n'
                f"assert {fn}({a.name!r}) == {a.capital!r}\nprint({fn}({b.name!r}))  # {b.capital}\n")
    if kind == 1:
        cont = rng.choice(world.continents)
        cs = world.countries_in(cont)[:8]
        pops = [(c.name, c.population_millions) for c in cs]
        best = max(pops, key=lambda kv: kv[1])[0]
        return (f"# Population in millions of countries in {cont}.\n" + _dict_literal("population", pops)
                + "\n\ntotal = 0\nfor name, millions in population.items():\n    total += millions\n"
                f"print(total)  # {sum(p for _, p in pops)}\n"
                f"print(max(population, key=population.get))  # {best}\n")
    if kind == 2:
        name, params, doc, body = rng.choice(_FUNCS)
        body = "".join(f"    {line}\n" for line in body.splitlines())
        namespace: dict = {}
        exec(f"def {name}({params}):\n{body}", namespace)  # run the snippet itself for the examples
        examples = "".join(f"    >>> {name}({', '.join(map(str, args))})\n    {namespace[name](*args)}\n"
                           for args in ([rng.randint(1, 12) for _ in params.split(",")]
                                        for _ in range(rng.randint(1, 3))))
        return f'def {name}({params}):\n    """{doc}\n\n{examples}    """\n{body}'
    if kind == 3:
        ps = rng.sample(world.people, min(rng.randint(3, 6), len(world.people)))
        year = rng.choice(ps).birth_year + 1
        rows = "".join(f"    Person({p.name!r}, {p.birth_year}, {p.city!r}, {p.profession!r}),\n" for p in ps)
        return ("from dataclasses import dataclass\n\n\n@dataclass\nclass Person:\n    name: str\n    born: int\n"
                f"    city: str\n    profession: str\n\n\nPEOPLE = [\n{rows}]\n\n\n"
                'def born_before(people, year):\n    """Return the names of people born before a year."""\n'
                "    return [p.name for p in people if p.born < year]\n\n\n"
                f"print(born_before(PEOPLE, {year}))  # {[p.name for p in ps if p.birth_year < year]}\n")
    lang = rng.choice(cs).language
    return (_dict_literal("LANGUAGES", [(c.name, c.language) for c in cs]) + "\n\n\ndef countries_speaking(language):\n"
            '    """Return the countries whose people speak a language."""\n    result = []\n'
            "    for country, spoken in LANGUAGES.items():\n        if spoken == language:\n"
            "            result.append(country)\n    return result\n\n\n"
            f"print(countries_speaking({lang!r}))  # {[c.name for c in cs if c.language == lang]}\n")


def code_documents(world: World, seed: int = 0) -> Iterator[str]:
    rng = _doc_rng("code", world, seed)
    while True:
        yield _code_document(rng, world)


# ---------------------------------------------------------------------- long


def _cut(text: str, lo: int, hi: int) -> str:
    """Shorten ``text`` to at most ``hi`` chars, at a paragraph/sentence/word boundary >= ``lo``."""
    if len(text) <= hi:
        return text
    head = text[:hi + 1]
    i = head.rfind("\n\n")
    while i >= lo:  # never end on a dangling section heading
        j = head.rfind("\n\n", 0, i)
        if not head[j + 2 if j >= 0 else 0:i].startswith("## "):
            break
        i = j
    if i >= lo:
        return text[:i]
    for sep, keep in ((". ", 1), (" ", 0)):
        i = head.rfind(sep)
        if lo <= i + keep <= hi:
            return text[:i + keep]
    return text[:hi]


def long_documents(world: World, seed: int = 0, min_chars: int = 4000,
                   max_chars: int = 16000) -> Iterator[str]:
    if not 0 <= min_chars <= max_chars or max_chars < 1:
        raise ValueError("need 0 <= min_chars <= max_chars and max_chars >= 1")
    rng = _doc_rng("long", world, seed)
    while True:
        cont = rng.choice(world.continents)
        parts = [rng.choice((f"A Traveler's Guide to {cont}", f"Notes on the Countries of {cont}",
                             f"{cont}: Lands and People"))]
        size = len(parts[0])
        pool = list(world.countries_in(cont))
        while size < min_chars:
            if not pool:
                pool = list(world.countries)
            c = pool.pop(rng.randrange(len(pool)))
            section = [f"## {c.name}", _paragraph(rng, world, country_sentences(rng, c), 0.3)]
            for p in rng.sample(world.people_in(c.name), min(3, len(world.people_in(c.name)))):
                section.append(_paragraph(rng, world, bio_sentences(rng, p), 0.2))
            section.append(" ".join(_filler_sentence(rng, world) for _ in range(rng.randint(1, 4))))
            for s in section:
                parts.append(s)
                size += len(s) + 2
        yield _cut("\n\n".join(parts), min_chars, max_chars)


# the built-in generators ``gen(world, seed, **kwargs) -> documents``; another registers the same way from a
# plugin module (stem.plugins), and a synth source's ``generator:`` names it. (Run as ``python -m
# stem.data.synth``, this copy is __main__ and the registry imports stem.data.synth, which registers them.)
if __name__ != "__main__":
    for _name, _gen in {"web": web_documents, "math": math_documents, "code": code_documents,
                        "long": long_documents}.items():
        GENERATORS.add(_name, _gen)

# ---------------------------------------------------------------------- output


def write_jsonl(path: str | os.PathLike, documents: Iterator[str], n_bytes: int | None) -> dict:
    """Write ``{"text": doc}`` lines until the UTF-8 text bytes reach ``n_bytes`` (None: every document); atomic."""
    n_docs = n_text = 0
    digest = hashlib.sha256()
    with atomic_open(path, "wb", fsync=True) as f:
        for doc in documents:
            if n_bytes is not None and n_text >= n_bytes:
                break
            line = (json.dumps({"text": doc}, ensure_ascii=False) + "\n").encode("utf-8")
            f.write(line)
            digest.update(line)
            n_docs += 1
            n_text += len(doc.encode("utf-8"))
    return {"documents": n_docs, "bytes": n_text, "sha256": digest.hexdigest()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kind", choices=sorted(GENERATORS), required=True)
    ap.add_argument("--bytes", type=int, required=True, help="stop once this many UTF-8 text bytes are written")
    ap.add_argument("--seed", type=int, default=0, help="document-stream seed")
    ap.add_argument("--world-seed", type=int, default=0)
    ap.add_argument("--min-chars", type=int, default=4000, help="long documents only")
    ap.add_argument("--max-chars", type=int, default=16000, help="long documents only")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    world = make_world(args.world_seed)
    extra = {"min_chars": args.min_chars, "max_chars": args.max_chars} if args.kind == "long" else {}
    result = write_jsonl(args.out, GENERATORS[args.kind](world, args.seed, **extra), args.bytes)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
