"""Where a result came from, recorded in the result itself (never in the job spec: Snakemake reruns a job
whose spec changes, and a commit changes with every edit).

``record(spec, manifests)`` is the ``provenance`` entry of every JSON result the pipeline writes (training
``summary.json``, evaluation and analysis JSONs, the DSE sweeps, the offload benchmark, gpucheck, the report's
``diff/summary.json``): the project's git commit and whether its tree was dirty (tracked files changed, named
in ``dirty_files``; None outside a git checkout), the versions of torch, lm-eval, snakemake and transformers
(None where one is not installed), the SHA-256 of the job spec (its canonical JSON, as ``spec_hash``), of each
data manifest the job read and of the tokenizer it used, and for an evaluation its data (``eval_data``).
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
    """{'commit': sha or None, 'dirty': bool or None, 'dirty_files': the changed tracked files} of the checkout
    at ``repo`` (once per process)."""
    def git(*args):
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=60)
    try:
        head = git("rev-parse", "HEAD")
        if head.returncode != 0:
            return {"commit": None, "dirty": None, "dirty_files": []}
        status = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):   # no git on this machine
        return {"commit": None, "dirty": None, "dirty_files": []}
    changed = [line[3:] for line in status.stdout.splitlines() if line.strip()] if status.returncode == 0 else []
    return {"commit": head.stdout.strip(), "dirty": bool(changed) if status.returncode == 0 else None,
            "dirty_files": changed}


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


def tree_hash(folder) -> str | None:
    """SHA-256 over a folder's files (each one's relative path and content, in sorted order); None if absent."""
    root = Path(folder)
    if not root.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(root).as_posix()}\0".encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def eval_data(spec: dict, raw: dict | None) -> dict:
    """What an evaluation read: the fixture folder's ``tree_hash`` (generated fixtures), the document files
    (NIAH / perplexity suites), per lm-eval task the SHA-256 of its items as lm-eval hashed them (``doc_hash``
    of every per-sample record: the data as read, fixtures or a hub dataset) and each hub dataset's path, name
    and pinned revision (null: the hub's newest, which ``items_sha256`` then pins after the fact)."""
    out = {}
    if spec.get("fixtures"):
        out["fixtures"] = {"dir": str(spec["fixtures"]), "sha256": tree_hash(spec["fixtures"])}
    readers = [spec.get("documents") or {}, *(spec.get("category_documents") or {}).values()]   # longppl: per category
    paths = [p for r in readers if isinstance(r, dict) for p in r.get("paths") or []]
    if paths:
        out["documents"] = {str(p): file_hash(p) for p in paths}
    samples = (raw or {}).get("samples") or {}
    if samples:
        out["items_sha256"] = {t: hashlib.sha256("\n".join(sorted(f"{s.get('doc_id')}:{s.get('doc_hash')}"
                                                                  for s in rows)).encode()).hexdigest()
                               for t, rows in sorted(samples.items())}
    hub = {t: {"path": c.get("dataset_path"), "name": c.get("dataset_name"),
               "revision": (c.get("dataset_kwargs") or {}).get("revision")}
           for t, c in sorted(((raw or {}).get("configs") or {}).items())
           if isinstance(c, dict) and c.get("dataset_path") not in (None, "json")}
    if hub:
        out["datasets"] = hub
    return out


def record(spec: dict | None = None, manifests=(), train_spec: dict | None = None, tokenizer=None,
           data: dict | None = None) -> dict:
    """The ``provenance`` entry of a result file. ``train_spec``: for an evaluation or analysis, the job spec of
    the checkpoint it read (its hash is what ties the result to a training summary); ``tokenizer``: the
    tokenizer.json used; ``data``: an evaluation's ``eval_data``."""
    out = {**git_state(), "versions": versions(),
           "spec_sha256": None if spec is None else spec_hash(spec),
           "manifests": {str(m): file_hash(m) for m in manifests}}
    if train_spec is not None:
        out["train_spec_sha256"] = spec_hash(train_spec)
    if tokenizer is not None:
        out["tokenizer_sha256"] = file_hash(tokenizer)
    if data is not None:
        out["data"] = data
    return out


def manifests_of(spec: dict) -> list[str]:
    """The data manifests a training job spec reads (its ``data`` sources)."""
    return [src["manifest"] for src in (spec.get("data") or {}).values() if isinstance(src, dict) and "manifest" in src]
