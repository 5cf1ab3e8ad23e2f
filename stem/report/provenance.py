"""The report's provenance table: for every training summary and evaluation JSON of the experiment, the commit
that produced it (and whether the tree was dirty), the versions of torch / lm-eval / snakemake / transformers,
the job spec's and the data manifests' hashes (stem.provenance). ``results_summary`` condenses it for the diff
summary: how many commits and versions the results come from, and the evaluations whose checkpoint's spec is
not the spec of the training summary beside them (results compared across different specs).
"""
from __future__ import annotations

import hashlib

import pandas as pd

from stem import config as C
from stem.config.experiment import Experiment
from stem.report import registry
from stem.report import tables as T

COLUMNS = ("commit", "torch", "lm_eval", "snakemake", "transformers", "spec", "manifests", "same_spec", "runtime")


def runtime_label(r: dict | None) -> str | None:
    """A result's ``runtime`` (stem.train.torchfloor.runtime) in a few words: device, dtype, threads, CPU kernels,
    deterministic or not, the kernel environment set; ``requested X`` where another device was asked for."""
    if not r:
        return None
    asked = r.get("requested_device")
    out = [str(r.get("device")), str(r.get("dtype")), f"{r.get('threads')}t", str(r.get("cpu_capability")),
           "det" if r.get("deterministic") else "nondet"] + [f"{k}={v}" for k, v in (r.get("env") or {}).items()]
    if asked and asked not in ("auto", str(r.get("device"))) and not str(r.get("device")).startswith(str(asked)):
        out.append(f"(requested {asked})")
    return " ".join(out)


def _short(h) -> str | None:
    return None if not h else f"sha256:{h[:12]}"


def commit_label(p: dict) -> str | None:
    """'<12 hex> clean' / '<12 hex> dirty' (never a number when read back from CSV), None when unknown."""
    if not p.get("commit"):
        return None
    return f"{p['commit'][:12]} {'dirty' if p.get('dirty') else 'clean' if p.get('dirty') is False else '?'}"


def _manifests(p: dict) -> str | None:
    m = p.get("manifests") or {}
    if not m:
        return None
    return _short(hashlib.sha256("".join(f"{k}={v};" for k, v in sorted(m.items())).encode()).hexdigest())


def _files(exp: Experiment, res):
    """(scale, variant, stage, what, path, JSON) of every training summary and evaluation JSON that exists."""
    suites = (exp.eval or {}).get("stages") or {}   # the eval section, untyped (stem.eval.spec)
    for scale, variant, stage in C.train_targets(exp) + C.seed_targets(exp):
        d = res.stage_dir(scale, variant, stage)
        yield scale, variant, stage, "summary", d / "summary.json", res.summary(scale, variant, stage)
        for s in suites.get(stage, []):
            yield scale, variant, stage, f"eval {s}", d / f"eval/{s}.json", res.eval(scale, variant, stage, s)


def rows(exp: Experiment, res) -> list[dict]:
    """One row per result file that exists: what its ``provenance`` entry says (None where it has none)."""
    out, train_hash = [], None
    for scale, variant, stage, what, path, data in _files(exp, res):
        if what == "summary":
            train_hash = ((data or {}).get("provenance") or {}).get("spec_sha256")
        if data is None:
            continue
        p = data.get("provenance") or {}
        v = p.get("versions") or {}
        same = None
        if what != "summary" and p.get("train_spec_sha256") and train_hash:
            same = "yes" if p["train_spec_sha256"] == train_hash else "NO"
        out.append({"scale": scale, "variant": variant, "stage": stage, "what": what, "path": str(path),
                    "commit": commit_label(p), "torch": v.get("torch"), "lm_eval": v.get("lm_eval"),
                    "snakemake": v.get("snakemake"), "transformers": v.get("transformers"),
                    "spec": _short(p.get("spec_sha256")), "manifests": _manifests(p), "same_spec": same,
                    "runtime": runtime_label(data.get("runtime"))})
    return out


def dirty(exp: Experiment, res) -> list[tuple[str, list[str]]]:
    """(path, the tracked files changed then) of every result file written from a dirty tree."""
    return [(str(path), (data["provenance"].get("dirty_files") or []))
            for *_, path, data in _files(exp, res) if ((data or {}).get("provenance") or {}).get("dirty")]


def provenance_long(exp: Experiment, res) -> pd.DataFrame:
    return T.frame([T.cell("provenance", r["scale"], r["variant"], c, r[c], r["path"],
                           row=f"{r['variant']} {r['stage']}: {r['what']}", unit="")
                    for r in rows(exp, res) for c in COLUMNS])


def results_summary(prov: pd.DataFrame | None) -> dict:
    """From the provenance table (long): result files counted per commit and per version set, the files
    without provenance, and the evaluations of a checkpoint whose spec differs from its training summary's."""
    if prov is None or prov.empty:
        return {"files": 0, "commits": {}, "versions": {}, "without": 0, "spec_mismatch": [], "runtimes": {}}
    files = [(src, dict(zip(g["column"], g["value"])))
             for (_, _, _, src), g in prov.groupby(["scale", "variant", "row", "source"], sort=False)]
    has = lambda v: v is not None and not T.isnan(v) and str(v) != ""  # noqa: E731
    commits = [str(f["commit"]) for _, f in files if has(f.get("commit"))]
    vers = [" ".join(f"{k} {f.get(k)}" for k in ("torch", "lm_eval", "snakemake", "transformers"))
            for _, f in files if has(f.get("torch"))]
    return {"files": len(files), "commits": {c: commits.count(c) for c in dict.fromkeys(commits)},
            "versions": {v: vers.count(v) for v in dict.fromkeys(vers)}, "without": len(files) - len(commits),
            "spec_mismatch": sorted(str(src) for src, f in files if f.get("same_spec") == "NO"),
            "runtimes": _count(str(f["runtime"]) for _, f in files if has(f.get("runtime")))}


def _count(xs) -> dict:
    xs = list(xs)
    return {x: xs.count(x) for x in dict.fromkeys(xs)}


registry.paper_table(
    "provenance", "Provenance: the commit, package versions, job spec and data manifests behind every result file",
    labels={"commit": "commit", "lm_eval": "lm-eval", "spec": "job spec", "manifests": "data manifests",
            "same_spec": "evaluated the summary's spec", "runtime": "computed with"},
    empty="_(no rows: no results yet)_")(provenance_long)
