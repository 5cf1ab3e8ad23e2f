import contextlib
import doctest
import functools
import io
import itertools
import json
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

from stem.data.synth import (
    GENERATORS, Country, Person, World, code_documents, long_documents, make_world,
    math_documents, web_documents, write_jsonl,
)


@pytest.fixture(scope="module")
def world():
    return make_world(0)


def take(gen, n):
    return list(itertools.islice(gen, n))


def test_world_shape_and_uniqueness(world):
    assert isinstance(world, World) and world.seed == 0
    assert len(world.countries) == 40 and len(world.people) == 200 and len(world.filler) == 2000
    assert all(isinstance(c, Country) for c in world.countries)
    assert all(isinstance(p, Person) for p in world.people)
    places = [c.name for c in world.countries] + [x for c in world.countries for x in c.cities]
    tokens = places + list(world.continents) + list(world.languages) \
        + [t for p in world.people for t in p.name.split()]
    assert len({t.lower() for t in tokens}) == len(tokens)  # all names unique
    assert not {w.lower() for w in tokens} & set(world.filler)
    assert len(set(world.filler)) == len(world.filler)
    for c in world.countries:
        assert c.capital == c.cities[0] and len(c.cities) >= 2
        assert c.population_millions >= 1 and world.country(c.name) is c
    for p in world.people:
        assert p.city in world.country(p.country).cities and world.city_country(p.city) == p.country
        assert 1700 <= p.birth_year <= 2000 and world.person(p.name) is p
    assert all(re.fullmatch(r"[A-Z][a-z]+", t) for t in tokens)


def test_world_deterministic(world):
    assert make_world(0) == world
    assert make_world(1) != world
    small = make_world(3, n_countries=2, n_people=2, n_filler=5)
    assert len(small.countries) == 2 and len(small.filler) == 5


def test_web_capital_sentences_match_world(world):
    docs = take(web_documents(world, 0), 200)
    found = 0
    for d in docs:
        for country, capital in re.findall(r"The capital of (\w+) is (\w+)\.", d):
            assert world.country(country).capital == capital
            found += 1
    assert found > 10


def test_web_other_facts_match_world(world):
    text = "\n".join(take(web_documents(world, 1), 400))
    checks = [
        (r"(\w+) is a country in (\w+) whose people speak (\w+)\.",
         lambda c, cont, lang: (world.country(c).continent, world.country(c).language) == (cont, lang)),
        (r"About (\d+) million people live in (\w+)\.",
         lambda pop, c: world.country(c).population_millions == int(pop)),
        (r"(\w+) is a city in (\w+)\.", lambda city, c: world.city_country(city) == c),
        (r"(\w+ \w+) was born in (\d+)\.", lambda n, y: world.person(n).birth_year == int(y)),
        (r"(\w+ \w+) worked as an? (\w+)\.", lambda n, prof: world.person(n).profession == prof),
        (r"Q: What is the capital of (\w+)\?\nA: (\w+)", lambda c, cap: world.country(c).capital == cap),
    ]
    for pattern, ok in checks:
        matches = re.findall(pattern, text)
        assert matches, pattern
        assert all(ok(*m) for m in matches), pattern


def test_web_templates_varied_and_filler(world):
    docs = take(web_documents(world, 0), 300)
    text = "\n".join(docs)
    capital_forms = ["The capital of", "is the capital of", "the capital city of", "'s capital is",
                     "The government of", "The capital city of"]
    assert all(f in text for f in capital_forms)
    assert sum(text.count(w) for w in world.filler[:5]) > 50  # Zipfian head is frequent
    lengths = [len(d) for d in docs]
    assert min(lengths) > 20 and max(lengths) > 600 and all(d.strip() == d for d in docs)


def test_math_answers_correct(world):
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b,
           "/": lambda a, b: a / b}
    problems = 0
    for d in take(math_documents(world, 0), 300):
        eqs = re.findall(r"(\d+) ([-+*/]) (\d+) = (\d+)", d)
        for a, op, b, c in eqs:
            assert ops[op](int(a), int(b)) == int(c), d
        if "####" in d:
            problems += 1
            assert d.startswith("Question: ") and "\nAnswer: " in d
            last = d.splitlines()[-1]
            assert re.fullmatch(r"#### \d+", last) and d.count("####") == 1
            assert int(last[5:]) == int(eqs[-1][3])
            m = re.match(r"Question: (\w+) has (\d+) million people and (\w+) has (\d+) million", d)
            if m:
                assert world.country(m[1]).population_millions == int(m[2])
                assert world.country(m[3]).population_millions == int(m[4])
    assert problems > 100


def test_code_documents_execute(world):
    for d in take(code_documents(world, 0), 150):
        module = types.ModuleType("synth_snippet")
        sys.modules["synth_snippet"] = module
        try:
            out = io.StringIO()
            with contextlib.redirect_stdout(out):
                exec(compile(d, "<snippet>", "exec"), module.__dict__)  # asserts inside must hold
            expected = re.findall(r"^print\(.*\)  # (.*)$", d, re.M)
            assert out.getvalue().splitlines() == expected, d
            failed, _ = doctest.testmod(module)
            assert failed == 0, d
        finally:
            del sys.modules["synth_snippet"]


@pytest.mark.parametrize("lo,hi", [(500, 800), (3000, 3000), (2000, 20000), (0, 50)])
def test_long_documents_length(world, lo, hi):
    for d in take(long_documents(world, 0, lo, hi), 20):
        assert lo <= len(d) <= hi
        if hi - lo >= 300:  # room to cut at a paragraph boundary
            assert not d.splitlines()[-1].startswith("## ")


def test_long_documents_structure(world):
    d = next(long_documents(world, 0, 8000, 12000))
    assert d.count("\n## ") >= 2
    for country, capital in re.findall(r"The capital of (\w+) is (\w+)\.", d):
        assert world.country(country).capital == capital
    with pytest.raises(ValueError):
        next(long_documents(world, 0, 10, 5))


def _generator_keys(kind: str) -> dict:
    """A generator's own keys (``gen(world, seed, **kw)``): the bios generator's world is config/knowledge.yaml's
    ``knowledge:`` section, with a source's n and exposures; the others need none."""
    if kind != "bios":
        return {}
    kn = yaml.safe_load((Path(__file__).resolve().parents[1] / "config" / "knowledge.yaml").read_text())["knowledge"]
    spec = {k: kn[k] for k in ("seed", "names", "attributes", "templates")}
    return {"knowledge": spec, "n": 100, "exposures": 20}


@pytest.mark.parametrize("kind", sorted(GENERATORS))
def test_write_jsonl_deterministic(tmp_path, world, kind):
    gen = functools.partial(GENERATORS[kind], **_generator_keys(kind))
    a = write_jsonl(tmp_path / "a.jsonl", gen(world, 0), 30_000)
    b = write_jsonl(tmp_path / "b.jsonl", gen(make_world(0), 0), 30_000)
    c = write_jsonl(tmp_path / "c.jsonl", gen(world, 1), 30_000)
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert a == b and a["sha256"] != c["sha256"]
    assert a["bytes"] >= 30_000
    lines = (tmp_path / "a.jsonl").read_text().splitlines()
    assert len(lines) == a["documents"]
    texts = [json.loads(x)["text"] for x in lines]
    assert sum(len(t.encode()) for t in texts) == a["bytes"]
    assert sum(len(t.encode()) for t in texts[:-1]) < 30_000  # stops as soon as the target is met
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.jsonl", "b.jsonl", "c.jsonl"]  # no tmp left


def test_world_seed_changes_documents(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", web_documents(make_world(0), 0), 10_000)
    b = write_jsonl(tmp_path / "b.jsonl", web_documents(make_world(1), 0), 10_000)
    assert a["sha256"] != b["sha256"]


def test_cli(tmp_path):
    out = tmp_path / "sub" / "x.jsonl"
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-m", "stem.data.synth", "--kind", "web", "--bytes", "20000",
                          "--seed", "0", "--out", str(out)], capture_output=True, text=True, check=True,
                         cwd=root, env=env)
    info = json.loads(res.stdout)
    assert info == write_jsonl(tmp_path / "y.jsonl", web_documents(make_world(0), 0), 20_000)
    assert out.exists()


def test_web_generation_speed(tmp_path, world):
    t = time.perf_counter()
    write_jsonl(tmp_path / "speed.jsonl", web_documents(world, 0), 1_000_000)
    assert time.perf_counter() - t < 10  # ~0.5 s expected; generous for loaded CI machines
