"""Read whatever the workflow has produced for one experiment; a missing or unreadable file is None.

Layout: ``{root}/{experiment}/{scale}/{variant}/{stage}/summary.json`` and ``metrics.jsonl`` (training),
``.../{stage}/eval/{suite}.json`` (evaluation; scores in percent). The eval readers are defensive
about the shape of ``tasks``/``groups``/``by_length`` so that small format changes show up as gaps,
not crashes.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pandas as pd

VALUE_KEYS = ("value", "score", "accuracy", "acc", "mean")


class Results:
    """The results tree of one experiment (``root`` is the folder that holds ``{experiment}/``)."""

    def __init__(self, experiment: str, root="results"):
        self.experiment, self.root = experiment, Path(root)

    def stage_dir(self, scale, variant, stage) -> Path:
        return self.root / self.experiment / scale / variant / stage

    def summary(self, scale, variant, stage) -> dict | None:
        return read_json(self.stage_dir(scale, variant, stage) / "summary.json")

    def metrics(self, scale, variant, stage) -> pd.DataFrame | None:
        path = self.stage_dir(scale, variant, stage) / "metrics.jsonl"
        if not path.is_file():
            return None
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a torn last line of a run still in progress
        return pd.DataFrame(rows) if rows else None

    def eval(self, scale, variant, stage, suite) -> dict | None:
        return read_json(self.stage_dir(scale, variant, stage) / "eval" / f"{suite}.json")

    def first_eval(self, scale, variant, stages, suite) -> tuple[dict | None, str | None]:
        """The eval JSON of the first stage in ``stages`` that has one (and that stage)."""
        for stage in stages:
            ev = self.eval(scale, variant, stage, suite)
            if ev is not None:
                return ev, stage
        return None, None


def read_json(path) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


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
