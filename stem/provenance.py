"""Where a result came from, recorded in the result itself (never in the job spec: Snakemake reruns a job
whose spec changes, and a commit changes with every edit).

``record(spec, manifests)`` is the ``provenance`` entry of every training ``summary.json``, evaluation JSON
and the report's ``diff/summary.json``: the project's git commit and whether its tree was dirty (tracked
files changed; None outside a git checkout), the versions of torch, lm-eval, snakemake and transformers
(None where one is not installed), the SHA-256 of the job spec (its canonical JSON, as ``spec_hash``) and
of each data manifest the job read.
"""
from __future__ import annotations

import functools
import hashlib
import json
import subprocess
from importlib import metadata
from pathlib import Path

from stem.layout import REPO

PACKAGES = {"torch": "torch", "lm_eval": "lm_eval", "snakemake": "snakemake", "transformers": "transformers"}


@functools.lru_cache(maxsize=4)
def git_state(repo: str = str(REPO)) -> dict:
    """{'commit': sha or None, 'dirty': bool or None} of the checkout at ``repo`` (once per process)."""
    def git(*args):
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=60)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None}
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):   # no git on this machine
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None}


@functools.lru_cache(maxsize=1)
def versions() -> dict:
    out = {}
    for key, dist in PACKAGES.items():
        try:
            out[key] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[key] = None
    return out


def spec_hash(spec: dict) -> str:
    """SHA-256 of a job spec's canonical JSON (keys sorted, no whitespace)."""
    return hashlib.sha256(json.dumps(spec, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def file_hash(path) -> str | None:
    p = Path(path)
    return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None


def record(spec: dict | None = None, manifests=(), train_spec: dict | None = None) -> dict:
    """The ``provenance`` entry of a result file. ``train_spec``: for an evaluation, the job spec of the
    checkpoint it evaluated (its hash is what ties the evaluation to a training summary)."""
    out = {**git_state(), "versions": versions(),
           "spec_sha256": None if spec is None else spec_hash(spec),
           "manifests": {str(m): file_hash(m) for m in manifests}}
    if train_spec is not None:
        out["train_spec_sha256"] = spec_hash(train_spec)
    return out


def manifests_of(spec: dict) -> list[str]:
    """The data manifests a training job spec reads (its ``data`` sources)."""
    return [src["manifest"] for src in (spec.get("data") or {}).values() if isinstance(src, dict) and "manifest" in src]
