"""Read whatever the workflow has produced for one experiment, checking every file it reads.

Layout: ``{root}/{experiment}/{scale}/{variant}/{stage}/summary.json`` and ``metrics.jsonl`` (training),
``.../{stage}/checkpoint/accounting.json`` (the model's parameter / FLOP accounting, written with its weights
and its job spec ``config.json``), ``.../{stage}/eval/{suite}.json`` (evaluation; scores in percent).
A file that does not exist yet is None (a gap in the tables); a file that exists must be what its path says (the experiment, scale,
variant, stage and suite it records) and in the agreed format (keys, types, ranges), or reading it
raises ``ResultError``: one line naming the file, the key, what was expected and what it holds.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd

VALUE_KEYS = ("value", "score", "accuracy", "acc", "mean")
IDENTITY = ("experiment", "scale", "variant", "stage")


class ResultError(ValueError):
    """A result file that is unreadable, not what its path says, or not in the agreed format."""


class Results:
    """The results tree of one experiment (``root`` is the folder that holds ``{experiment}/``)."""

    def __init__(self, experiment: str, root="results"):
        self.experiment, self.root = experiment, Path(root)

    def stage_dir(self, scale, variant, stage) -> Path:
        return self.root / self.experiment / scale / variant / stage

    def _identity(self, scale, variant, stage) -> dict:
        return dict(zip(IDENTITY, (self.experiment, scale, variant, stage)))

    def summary(self, scale, variant, stage) -> dict | None:
        path = self.stage_dir(scale, variant, stage) / "summary.json"
        data = read_json(path)
        if data is not None:
            check_summary(path, data, self._identity(scale, variant, stage))
        return data

    def metrics(self, scale, variant, stage) -> pd.DataFrame | None:
        path = self.stage_dir(scale, variant, stage) / "metrics.jsonl"
        if not path.is_file():
            return None
        lines = path.read_text().splitlines()
        rows = []
        for i, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                if i == len(lines):
                    continue  # a torn last line of a run still in progress
                raise ResultError(f"{path}:{i}: not a JSON line") from None
            if not isinstance(row, dict):
                raise ResultError(f"{path}:{i}: expected a JSON object, got {type(row).__name__}")
            for key in ("step", "loss"):
                _number(f"{path}:{i}", row, key, 0, math.inf, required=True)
            rows.append(row)
        return pd.DataFrame(rows) if rows else None

    def eval(self, scale, variant, stage, suite) -> dict | None:
        path = self.stage_dir(scale, variant, stage) / "eval" / f"{suite}.json"
        data = read_json(path)
        if data is not None:
            check_eval(path, data, {**self._identity(scale, variant, stage), "suite": suite})
        return data

    def accounting(self, scale, variant, stage) -> dict | None:
        """The accounting saved with the stage's checkpoint; the checkpoint's job spec (config.json) must be
        this experiment, scale, variant and stage."""
        ckpt = self.stage_dir(scale, variant, stage) / "checkpoint"
        data = read_json(ckpt / "accounting.json")
        if data is not None:
            spec = read_json(ckpt / "config.json")
            if spec is None:
                raise ResultError(f"{ckpt / 'config.json'}: missing (the checkpoint's job spec, beside "
                                  "accounting.json)")
            _identity(ckpt / "config.json", spec, self._identity(scale, variant, stage))
            check_accounting(ckpt / "accounting.json", data)
        return data

    def first_accounting(self, scale, variant, stages) -> tuple[dict | None, str | None]:
        """The checkpoint accounting of the first stage in ``stages`` that has one (and that stage)."""
        for stage in stages:
            acct = self.accounting(scale, variant, stage)
            if acct is not None:
                return acct, stage
        return None, None

    def first_eval(self, scale, variant, stages, suite) -> tuple[dict | None, str | None]:
        """The eval JSON of the first stage in ``stages`` that has one (and that stage)."""
        for stage in stages:
            ev = self.eval(scale, variant, stage, suite)
            if ev is not None:
                return ev, stage
        return None, None


def read_json(path) -> dict | None:
    """The JSON object in ``path``; None if there is no such file; ResultError if it is not one."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ResultError(f"{path}: not readable as JSON ({e})") from None
    if not isinstance(data, dict):
        raise ResultError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


# ---- validation: what a result file must hold -----------------------------------------------------
def _fail(where, key, expected, got):
    raise ResultError(f"{where}: key '{key}': expected {expected}, got {got!r}")


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _number(where, d: dict, key: str, lo: float, hi: float, required=True, nullable=False, name=None,
            integer=False, allow_nan=False):
    """Check ``d[key]`` is a number in [lo, hi] (an int if ``integer``; null if ``nullable``)."""
    name = name or key
    noun = "integer" if integer else "number"
    expected = (f"a{'n' * integer} {noun} in [{lo:g}, {hi:g}]" if hi < math.inf else f"a finite {noun} >= {lo:g}") \
        + (" or null" if nullable else "") + (" or NaN" if allow_nan else "")
    if key not in d:
        if required:
            raise ResultError(f"{where}: key '{name}' is missing (expected {expected})")
        return
    x = d[key]
    if x is None and nullable:
        return
    if not _is_number(x) or (integer and not isinstance(x, int)):
        _fail(where, name, expected, x)
    if allow_nan and math.isnan(x):
        return
    if not math.isfinite(x) or not lo <= x <= hi:
        _fail(where, name, expected, x)


def _identity(where, d: dict, expected: dict):
    """The experiment/scale/variant/stage (and suite) the file records must be those of its path."""
    for key, want in expected.items():
        got = d.get(key)
        if not isinstance(got, str):
            _fail(where, key, f"the string {want!r} (from the file's path)", got)
        if got != want:
            raise ResultError(f"{where}: key '{key}': the file is of {key} {got!r} but its path says {want!r} "
                              "(a result of another run in this folder?)")


def check_summary(path, d: dict, identity: dict):
    """A training summary.json (stem.train.loop): identity, losses, steps and tokens."""
    _identity(path, d, identity)
    _number(path, d, "final_val_loss", 0, math.inf, nullable=True, allow_nan=True)  # NaN: no validation split
    imported = d.get("steps") == 0   # a stage that only imports (steps: 0): no training loss, no tokens
    _number(path, d, "final_train_loss", 0, math.inf, nullable=imported)
    for key in ("steps", "tokens"):
        _number(path, d, key, 0 if imported else 1, math.inf, integer=True)


def check_accounting(path, d: dict):
    """A checkpoint's accounting.json (stem.models.accounting): parameter counts and GFLOPs per token."""
    for key in ("total_params", "paper_total_params", "active_params"):
        _number(path, d, key, 1, math.inf, integer=True)
    _number(path, d, "gflops_per_token", 0, math.inf)


def _entries(path, d: dict, where: str, lo: float, hi: float):
    block = d.get(where, {})
    if not isinstance(block, dict):
        _fail(path, where, "an object {task: {value, stderr, ...}}", block)
    for name, e in block.items():
        if not isinstance(e, dict):
            _fail(path, f"{where}.{name}", "an object with a 'value'", e)
        _number(path, e, "value", lo, hi, nullable=True, name=f"{where}.{name}.value")
        _number(path, e, "stderr", 0, math.inf, required=False, nullable=True, name=f"{where}.{name}.stderr")


def check_eval(path, d: dict, identity: dict):
    """An eval JSON (stem.eval.run.evaluate): identity, per-task scores in percent (perplexities for ``unit:
    perplexity`` entries), LongBench rows by length, NIAH cells, truncation counts."""
    _identity(path, d, identity)
    if not isinstance(d.get("tasks"), dict):
        _fail(path, "tasks", "an object {task: {value, stderr, ...}}", d.get("tasks"))
    ppl = any(isinstance(e, dict) and e.get("unit") == "perplexity" for e in d["tasks"].values())
    for where in ("tasks", "groups"):
        _entries(path, d, where, 0, math.inf if ppl else 100)
    by_length = d.get("by_length", {})
    if not isinstance(by_length, dict):
        _fail(path, "by_length", "an object {table: [rows]}", by_length)
    for table, rows in by_length.items():
        if not isinstance(rows, list):
            continue  # "field", "metric": labels
        for i, row in enumerate(rows):
            groups = row.get("groups") if isinstance(row, dict) else None
            if not isinstance(groups, dict):
                _fail(path, f"by_length.{table}[{i}].groups", "an object {group: score}", groups)
            for g in groups:
                _number(path, groups, g, 0, 100, nullable=True, name=f"by_length.{table}[{i}].groups.{g}")
    cut = d.get("truncation", {})   # absent in eval JSONs written before the counts (stem.report.truncation)
    if not isinstance(cut, dict) or not isinstance(cut.get("tasks", {}), dict):
        _fail(path, "truncation", "an object {policy, context, tasks: {task: {requests, truncated, tokens_dropped}}}",
              cut)
    for task, n in cut.get("tasks", {}).items():
        if not isinstance(n, dict):
            _fail(path, f"truncation.tasks.{task}", "an object {requests, truncated, tokens_dropped}", n)
        for key in ("requests", "truncated", "tokens_dropped"):
            _number(path, n, key, 0, math.inf, integer=True, name=f"truncation.tasks.{task}.{key}")
    cells = d.get("cells", [])
    if not isinstance(cells, list):
        _fail(path, "cells", "a list of {length, depth, accuracy}", cells)
    for i, c in enumerate(cells):
        if not isinstance(c, dict):
            _fail(path, f"cells[{i}]", "an object {length, depth, accuracy}", c)
        _number(path, c, "length", 1, math.inf, integer=True, name=f"cells[{i}].length")
        _number(path, c, "depth", 0, 100, name=f"cells[{i}].depth")
        _number(path, c, "accuracy", 0, 100, name=f"cells[{i}].accuracy")


def as_number(x) -> float | None:
    """A float from a number or a dict carrying one (``{"value": ..}``, ``{"score": ..}``, ...)."""
    if isinstance(x, dict):
        x = next((x[k] for k in VALUE_KEYS if k in x), None)
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def task_score(ev: dict | None, name: str) -> float | None:
    """The score (percent) of task ``name`` in an eval JSON, looked up in ``tasks`` then ``groups``
    (also as ``leaderboard_<name>``); a suite with a single entry answers for its own name."""
    if not ev:
        return None
    entries = {**(ev.get("groups") or {}), **(ev.get("tasks") or {})}
    for key in (name, f"leaderboard_{name}"):
        if key in entries:
            return as_number(entries[key])
    if ev.get("suite") == name:
        for where in ("groups", "tasks"):
            if len(ev.get(where) or {}) == 1:
                return as_number(next(iter(ev[where].values())))
    return None


# ---- LongBench by context length ----------------------------------------------------------------
def parse_range(text: str) -> tuple[float, float] | None:
    """A context-length bucket in thousands of tokens: '<4k' -> (0, 4), '4–8k' -> (4, 8),
    '>=8k' / '≥8k' / '8k+' / 'ge8k' -> (8, inf), '0-2000' -> (0, 2)."""
    s = text.lower().replace("–", "-").replace("—", "-").replace("≥", ">=").replace(" ", "")
    k = lambda v: float(v) / 1000 if float(v) >= 100 else float(v)  # noqa: E731  (tokens or k-tokens)
    if m := re.search(r"(?:^|[_\-])(?:lt|<|under)(\d+)k?$|^(?:lt|<)(\d+)k?", s):
        return 0.0, k(m.group(1) or m.group(2))
    if m := re.search(r"(?:ge|>=|over)_?(\d+)k?$", s) or re.search(r"(\d+)k?(?:\+|_?plus)$", s):
        return k(m.group(1)), math.inf
    if m := re.search(r"(\d+)k?(?:-|_|to)(\d+)k?$", s):
        return k(m.group(1)), k(m.group(2))
    return None


def _group_of(path: str) -> str:
    p = path.lower()
    return "multi" if "multi" in p else "code" if "code" in p else "overall"


def _flatten(obj, prefix=""):
    if isinstance(obj, dict) and as_number(obj) is None:
        for key, val in obj.items():
            yield from _flatten(val, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(obj, list):
        for item in obj:
            if isinstance(item, dict):
                label = "/".join(str(v) for v in item.values() if isinstance(v, str))
                yield f"{prefix}/{label}" if prefix else label, as_number(item)
    else:
        yield prefix, as_number(obj)


def by_length(ev: dict | None) -> dict[tuple[str, float, float], float]:
    """``{(group, lo_k, hi_k): score}`` with group 'multi', 'code' or 'overall'."""
    out = {}
    for path, value in _flatten((ev or {}).get("by_length") or {}):
        last = path.rsplit("/", 1)[-1]
        rng = parse_range(last) or parse_range(path)
        if value is not None and rng is not None:
            out[(_group_of(path), *rng)] = value
    return out


def range_rows(ev: dict | None, table: str) -> list[dict] | None:
    """The eval harness's own per-table ranges: ``by_length[table]`` = [{"range", "lo", "hi", "groups":
    {group: score}}, ...] in the order of the paper's columns (edges scaled to the experiment)."""
    rows = ((ev or {}).get("by_length") or {}).get(table)
    return [r for r in rows if isinstance(r, dict)] if isinstance(rows, list) else None


def niah_cells(ev: dict | None) -> pd.DataFrame:
    """NIAH cells as a DataFrame [length, depth, accuracy] (accuracy in percent); empty if none."""
    rows = []
    for c in (ev or {}).get("cells") or []:
        if isinstance(c, dict):
            length, depth, acc = (as_number(c.get(k)) for k in ("length", "depth", "accuracy"))
            if None not in (length, depth, acc):
                rows.append({"length": int(length), "depth": depth, "accuracy": acc})
    return pd.DataFrame(rows, columns=["length", "depth", "accuracy"])
