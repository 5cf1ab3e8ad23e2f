"""Per-item comparison of two models' evaluations (``python -m stem compare A B --suite S``).

From lm-eval's per-sample logs (the raw output beside each eval JSON, ``eval/raw/{suite}.json``, written with
``log_samples``): for every task both evaluated, the items (same ``doc_id`` and filter) where the two models'
answers differ, with both answers, the gold one and each model's score on the item. A multiple-choice item's
answer is the choice of highest log-likelihood, per character where the task reports ``acc_norm`` (what the
task's metric scores); a generated one is the filtered response.
"""
from __future__ import annotations

import json
from pathlib import Path

from stem import layout

METRICS = ("acc", "acc_norm", "exact_match", "score")   # the per-item score shown, the first the sample has


class CompareError(ValueError):
    """A model or suite that cannot be compared (one line: the file and what was expected)."""


def raw_path(model: str, suite: str, experiment: str, results="results", stage: str = "pretrain") -> Path:
    """``model``: a raw JSON file, a stage folder (holding eval/raw/{suite}.json), or scale/variant[/stage]
    under ``results``."""
    p = Path(model)
    if p.is_file():
        return p
    if p.is_dir():
        for cand in (p / "eval" / "raw" / f"{suite}.json", p / "raw" / f"{suite}.json"):
            if cand.is_file():
                return cand
        raise CompareError(f"{model}: no eval/raw/{suite}.json in this folder (expected a stage folder of results/)")
    parts = model.strip("/").split("/")
    if len(parts) not in (2, 3):
        raise CompareError(f"model {model!r}: expected a raw JSON file, a stage folder or scale/variant[/stage]")
    scale, variant, st = (*parts, stage) if len(parts) == 2 else parts
    cand = Path(results) / Path(layout.eval_raw(experiment, scale, variant, st, suite)).relative_to("results")
    if not cand.is_file():
        raise CompareError(f"model {model!r}: {cand} not found (evaluate it first, or give the raw JSON's path)")
    return cand


def load_samples(path) -> dict[str, list[dict]]:
    try:
        raw = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise CompareError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    samples = raw.get("samples") if isinstance(raw, dict) else None
    if not isinstance(samples, dict) or not samples:
        raise CompareError(f"{path}: no per-sample logs (key 'samples'; lm-eval's log_samples output expected)")
    return samples


def _choices(s: dict) -> list[str] | None:
    """The continuation of each loglikelihood request (a multiple-choice item's choices), else None."""
    args = s.get("arguments")
    if isinstance(args, dict):   # older lm-eval: {"gen_args_0": {"arg_0": ctx, "arg_1": cont}, ...}
        args = [list(a.values()) for a in args.values()]
    resps = s.get("filtered_resps") or []
    if args and len(args) == len(resps) and all(isinstance(r, (list, tuple)) and r and isinstance(r[0], (int, float))
                                                for r in resps):
        return [str(a[1]) if len(a) > 1 else "" for a in args]
    return None


def _label(choices: list[str], i: int) -> str:
    """A choice as printed: its text, or 'choice i' where the choices share their text (e.g. WinoGrande, whose
    options are in the contexts)."""
    return choices[i].strip() if len(set(choices)) == len(choices) else f"choice {i}"


def answer(s: dict, metric: str = "acc") -> str:
    """The model's answer as ``metric`` scores it: acc_norm divides each choice's log-likelihood by the choice's
    length in characters (lm-eval's acc_norm), acc takes it as is."""
    choices = _choices(s)
    resps = s.get("filtered_resps") or []
    if choices is not None:
        norm = (lambda i: max(len(choices[i]), 1)) if metric == "acc_norm" else (lambda i: 1)
        return _label(choices, max(range(len(resps)), key=lambda i: resps[i][0] / norm(i)))
    r = resps[0] if resps else ""
    while isinstance(r, list) and r:
        r = r[0]
    return str(r).strip()


def gold(s: dict) -> str:
    t, choices = s.get("target"), _choices(s)
    if choices is not None and isinstance(t, int) and 0 <= t < len(choices):
        return _label(choices, t)
    if isinstance(t, list) and t:
        return " | ".join(str(x).strip() for x in t)
    return str(t).strip()


def score(s: dict, metric: str | None = None):
    if metric and isinstance(s.get(metric), (int, float)):
        return s[metric]
    return next((s[m] for m in METRICS if isinstance(s.get(m), (int, float))), None)


def task_metrics(raw_json) -> dict[str, str]:
    """{task: metric name} the eval JSON beside a raw one reports (eval/{suite}.json for eval/raw/{suite}.json);
    {} when there is none (each item then shows its first of METRICS)."""
    p = Path(raw_json)
    res = p.parent.parent / p.name
    if p.parent.name != "raw" or not res.is_file():
        return {}
    data = json.loads(res.read_text())
    return {t: e["metric"].split(",")[0] for t, e in (data.get("tasks") or {}).items()
            if isinstance(e, dict) and isinstance(e.get("metric"), str)}


def compare(a_path, b_path, tasks=None, metric: str | None = None) -> list[dict]:
    """One row per item both evaluated: task, doc_id, both answers and scores (``metric``, by default the one
    the eval JSON beside the first reports for the task), the gold answer, and whether the answers are the same."""
    a, b = load_samples(a_path), load_samples(b_path)
    metrics = task_metrics(a_path)
    common = [t for t in a if t in b and (not tasks or t in tasks)]
    if not common:
        raise CompareError(f"{a_path} and {b_path}: no task in common"
                           + (f" among {', '.join(tasks)}" if tasks else "") + f" (first: {', '.join(sorted(a))}; "
                           f"second: {', '.join(sorted(b))})")
    rows = []
    for task in sorted(common):
        bi = {(int(s["doc_id"]), s.get("filter", "none")): s for s in b[task]}
        for s in sorted(a[task], key=lambda s: int(s["doc_id"])):
            t = bi.get((int(s["doc_id"]), s.get("filter", "none")))
            if t is None:
                continue
            m = metric or metrics.get(task, "acc_norm" if "acc_norm" in s else "acc")
            ans_a, ans_b, g, sa, sb = answer(s, m), answer(t, m), gold(s), score(s, m), score(t, m)
            if ans_a.startswith("choice ") and not g.startswith("choice "):   # the target is not a choice index:
                g = ans_a if sa == 1 else ans_b if sb == 1 else f"neither {ans_a} nor {ans_b}"   # the one scored 1
            rows.append({"task": task, "doc_id": int(s["doc_id"]), "filter": s.get("filter", "none"), "metric": m,
                         "a": ans_a, "b": ans_b, "gold": g, "a_score": sa, "b_score": sb, "same": ans_a == ans_b})
    return rows


def summary(rows: list[dict]) -> list[dict]:
    """Per task: items compared, answers differing, and of those which model scored better."""
    out = {}
    for r in rows:
        d = out.setdefault(r["task"], {"task": r["task"], "items": 0, "differ": 0, "a_better": 0, "b_better": 0})
        d["items"] += 1
        if not r["same"]:
            d["differ"] += 1
            if r["a_score"] is not None and r["b_score"] is not None:
                d["a_better"] += r["a_score"] > r["b_score"]
                d["b_better"] += r["b_score"] > r["a_score"]
    return list(out.values())


def render(a_name: str, b_name: str, rows: list[dict], width: int = 60) -> str:
    cut = lambda x: (x if len(x) <= width else x[:width - 1] + "…").replace("|", r"\|").replace("\n", " ")  # noqa: E731
    mark = lambda x: "" if x is None else " ✓" if x > 0 else " ✗"  # noqa: E731
    out = [f"# Per-item comparison: A = {a_name}, B = {b_name}", "",
           "| Task | Items | Answers differ | A scores higher | B scores higher |", "|---|---|---|---|---|"]
    out += [f"| {s['task']} | {s['items']} | {s['differ']} | {s['a_better']} | {s['b_better']} |" for s in summary(rows)]
    diff = [r for r in rows if not r["same"]]
    out += ["", f"## Items where the answers differ ({len(diff)}; ✓ / ✗: the item's score)", ""]
    if diff:
        out += ["| Task | doc_id | A | B | Gold |", "|---|---|---|---|---|"]
        out += [f"| {r['task']} | {r['doc_id']} | {cut(r['a'])}{mark(r['a_score'])} | {cut(r['b'])}{mark(r['b_score'])} "
                f"| {cut(r['gold'])} |" for r in diff]
    else:
        out.append("_(none: the two models give the same answer on every item both evaluated)_")
    return "\n".join(out) + "\n"
