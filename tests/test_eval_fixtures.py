"""Every fixture item has exactly one correct answer: re-derived here from the world's facts (or by
re-computing the arithmetic), independently of the generators, for every item of every fixture task."""
import ast
import json
import re

import pytest

pytest.importorskip("lm_eval")

from stem import config as C  # noqa: E402
from stem.data.synth import make_world  # noqa: E402
from stem.eval import fixtures, ruler_data  # noqa: E402
from conftest import checked_yaml  # noqa: E402

SMALL_WORLD = {"seed": 3, "n_countries": 8, "n_people": 20, "n_filler": 100}  # few people: many shared attributes


class Facts:
    """Which options are true, from the world's tables only."""

    def __init__(self, w):
        self.person = {p.name: p for p in w.people}
        self.country = {c.name: c for c in w.countries}
        self.city_country = {}
        for c in w.countries:
            for city in c.cities:
                self.city_country.setdefault(city, set()).add(c.name)

    def answer_test(self, q: str):
        """A predicate over option texts for a question about the world."""
        unart = lambda s: s.split(" ", 1)[1] if s.split(" ", 1)[0] in ("a", "an") else s  # noqa: E731
        pats = [
            (r"In what year was (.+) born\?", lambda m: lambda o: o == str(self.person[m[1]].birth_year)),
            (r"What was the profession of (.+)\?", lambda m: lambda o: unart(o) == self.person[m[1]].profession),
            (r"In which country did (.+) live\?", lambda m: lambda o: o == self.person[m[1]].country),
            (r"What is the capital of (.+)\?", lambda m: lambda o: o == self.country[m[1]].capital),
            (r"Which continent is (.+) in\?", lambda m: lambda o: o == self.country[m[1]].continent),
            (r"What language do people speak in (.+)\?", lambda m: lambda o: o == self.country[m[1]].language),
            (r"In which country is the city of (.+)\?", lambda m: lambda o: o in self.city_country[m[1]]),
            (r"What is (-?\d+) ([-+*]) (-?\d+)\?", lambda m: lambda o: int(o) == _arith(m[1], m[2], m[3])),
        ]
        for pat, make in pats:
            m = re.fullmatch(pat, q)
            if m:
                return make(m)
        raise AssertionError(f"unrecognised question {q!r}")


def _arith(a, op, b):
    a, b = int(a), int(b)
    if op == "/":
        assert b and a % b == 0, f"{a} / {b} is not a whole number"
        return a // b
    return a + b if op == "+" else a - b if op == "-" else a * b


def _correct(options, test):
    return [i for i, o in enumerate(options) if test(o)]


def _bool(expr: str) -> bool:
    """An independent evaluator of the BBH boolean expressions (True/False, not, and, or, parentheses)."""
    toks = expr.replace("(", " ( ").replace(")", " ) ").split()

    def parse_or(i):
        v, i = parse_and(i)
        while i < len(toks) and toks[i] == "or":
            w, i = parse_and(i + 1)
            v = v or w
        return v, i

    def parse_and(i):
        v, i = parse_not(i)
        while i < len(toks) and toks[i] == "and":
            w, i = parse_not(i + 1)
            v = v and w
        return v, i

    def parse_not(i):
        if toks[i] == "not":
            v, i = parse_not(i + 1)
            return not v, i
        if toks[i] == "(":
            v, i = parse_or(i + 1)
            assert toks[i] == ")"
            return v, i + 1
        return {"True": True, "False": False}[toks[i]], i + 1

    v, i = parse_or(0)
    assert i == len(toks)
    return v


def _arith_expr(expr: str) -> int:
    """Integer + - * with parentheses and precedence, evaluated through Python's AST (no eval)."""
    def ev(n):
        if isinstance(n, ast.Expression):
            return ev(n.body)
        if isinstance(n, ast.Constant):
            return n.value
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.USub):
            return -ev(n.operand)
        if isinstance(n, ast.BinOp):
            a, b = ev(n.left), ev(n.right)
            return {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b}[type(n.op)]
        raise AssertionError(ast.dump(n))
    return ev(ast.parse(expr, mode="eval"))


def check_item(task: str, d: dict, f: Facts):
    """Assert that the gold answer is the one and only correct answer of item ``d``."""
    if task.startswith("arc_"):
        ok = _correct(d["choices"]["text"], f.answer_test(d["question"]))
        assert ok == [d["choices"]["label"].index(d["answerKey"])]
    elif task == "openbookqa":
        c = re.fullmatch(r"The capital of (.+) is", d["question_stem"])[1]
        ok = _correct(d["choices"]["text"], lambda o: o == f.country[c].capital)
        assert ok == [d["choices"]["label"].index(d["answerKey"])]
    elif task == "boolq":
        q, c = d["question"], None
        if m := re.fullmatch(r"is (.+) the capital of (.+)", q):
            truth = f.country[m[2]].capital == m[1]
        elif m := re.fullmatch(r"is (.+) a country in (.+)", q):
            truth = f.country[m[1]].continent == m[2]
        elif m := re.fullmatch(r"do people in (.+) speak (.+)", q):
            truth = f.country[m[1]].language == m[2]
        else:
            raise AssertionError(q)
        assert d["label"] == int(truth), (q, c)
    elif task == "piqa":
        c = re.fullmatch(r"How do you visit the capital of (.+)\?", d["goal"])[1]
        ok = _correct([d["sol1"], d["sol2"]], lambda o: o == f"Travel to {f.country[c].capital}.")
        assert ok == [d["label"]]
    elif task == "social_iqa":
        ok = _correct([d["answerA"], d["answerB"], d["answerC"]], f.answer_test(d["question"]))
        assert ok == [int(d["label"]) - 1]
    elif task == "hellaswag":
        c = re.fullmatch(r".* The capital of (.+) is", d["ctx"])[1]
        ok = _correct(d["endings"], lambda o: o == f.country[c].capital + ".")
        assert ok == [int(d["label"])]
    elif task == "winogrande":
        cap = re.fullmatch(r"The capital of _ is (.+)\.", d["sentence"])[1]
        ok = _correct([d["option1"], d["option2"]], lambda o: f.country[o].capital == cap)
        assert ok == [int(d["answer"]) - 1]
    elif task.startswith("mmlu_"):
        assert _correct(d["choices"], f.answer_test(d["question"])) == [d["answer"]]
    elif task == "gsm8k":
        *steps, final = d["answer"].split("\n")
        last = None
        for s in steps:
            eqs = re.findall(r"(-?\d+) ([-+*/]) (-?\d+) = (-?\d+)", s)
            assert eqs, s
            for a, op, b, c in eqs:
                assert _arith(a, op, b) == int(c), s
                last = int(c)
        assert final == f"#### {last}"
    elif task == "bbh_cot_fewshot_boolean_expressions":
        assert d["target"] == str(_bool(d["input"].removesuffix(" is")))
    elif task == "bbh_cot_fewshot_multistep_arithmetic_two":
        assert int(d["target"]) == _arith_expr(d["input"].removesuffix(" ="))
    elif task == "bbh_cot_fewshot_object_counting":
        items = re.fullmatch(r"I have (.+)\. How many items do I have\?", d["input"])[1]
        assert int(d["target"]) == sum(int(x.split(" ", 1)[0]) for x in items.split(", "))
    elif task.startswith("leaderboard_musr_"):
        choices = ast.literal_eval(d["choices"])
        if m := re.fullmatch(r"Which city would (.+) most likely be found in\?", d["question"]):
            ok = _correct(choices, lambda o: o == f.person[m[1]].city)
        elif m := re.fullmatch(r"Who was born in (\d+)\?", d["question"]):
            ok = _correct(choices, lambda o: f.person[o].birth_year == int(m[1]))
        elif m := re.fullmatch(r"Who worked as an? (.+)\?", d["question"]):
            ok = _correct(choices, lambda o: f.person[o].profession == m[1])
        else:
            raise AssertionError(d["question"])
        assert ok == [d["answer_index"]] and choices[d["answer_index"]] == d["answer_choice"], d["question"]
        assert len(set(choices)) == len(choices)
    elif task.startswith("longbench_"):
        assert len(d["answers"]) == 1 and d["answers"][0].strip()
        if task in ("longbench_lcc", "longbench_repobench-p"):
            return  # the next line of a generated file: one reference by construction
        name = re.fullmatch(r"In which country did (.+) live\?", d["input"])[1]
        p = f.person[name]
        assert d["answers"] == [p.country]
        assert f"{p.name} lived in {p.city}" in d["context"] and f"{p.city} is a city in {p.country}" in d["context"]
    else:
        raise AssertionError(f"no checker for fixture task {task}")


@pytest.mark.parametrize("world", ["tiny", "small"])
def test_every_fixture_item_has_exactly_one_correct_answer(tmp_path, world):
    cfg = checked_yaml(C.REPO / "config" / "tiny.yaml")
    fx = cfg["eval"]["fixtures"]   # without the RULER stand-in (several answers an item): tests/test_long_context.py
    tasks = [t for t in fx["tasks"] if t not in ruler_data.TASKS]
    spec = {**{k: v for k, v in fx.items() if k != "ruler"}, "tasks": tasks,
            "groups": {g: m for g, m in fx["groups"].items() if g != "ruler"},
            "world": cfg["world"] if world == "tiny" else SMALL_WORLD, "seed": cfg["seed"]}
    if world == "small":  # more items on the crowded world (the generators' rarer branches)
        spec.update(items=120, items_by_prefix={"longbench_": 8, "bbh_": 60})
    manifest = fixtures.write_fixtures(spec, tmp_path)
    f = Facts(make_world(**spec["world"]))
    assert set(manifest["tasks"]) == set(tasks)
    n = 0
    for task in manifest["tasks"]:
        for split in manifest["tasks"][task]["splits"]:
            for line in (tmp_path / task / f"{split}.jsonl").read_text().splitlines():
                check_item(task, json.loads(line), f)
                n += 1
    assert n == sum(sum(t["splits"].values()) for t in manifest["tasks"].values()) > 500


def test_musr_items_are_unambiguous_on_a_crowded_world():
    """Three people with 20 in the world share birth years / professions often; the old generator asked
    about an attribute two of the shown people had (25 of 200 items)."""
    w = make_world(**SMALL_WORLD)
    f = Facts(w)
    import random
    for sub in ("murder_mysteries", "team_allocation", "object_placements"):
        rng = random.Random(sub)
        for i in range(300):
            check_item(f"leaderboard_musr_{sub}", fixtures.musr(rng, w, i, f"leaderboard_musr_{sub}"), f)
