"""Atomic writes: a file or folder appears whole under its final name, or not at all. And the reading of the
YAML configs (``read_yaml``, ``deep_merge``, config/variants.yaml as read), whose problems are a
one-line ``ConfigError`` (stem.config re-exports these; stem.seeds and stem.sweeps, below it, use them here).

Every output of the pipeline is written through these (a killed job leaves no half-written file for
Snakemake or a reader to trust). Temp names start with a dot, next to the target (same filesystem, so the
final ``os.replace`` is atomic); a failed write removes its temp. Files and folders get the modes a plain
``open``/``mkdir`` would give (0666/0777 less the umask), not mkstemp's 0600/0700.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import tempfile
from functools import lru_cache
from pathlib import Path

import yaml

from stem.fields import key_of
from stem.layout import VARIANTS


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(path):
    """Yield a temp file path next to ``path`` for a writer that takes a path (``lib.save(tmp)``); renamed over
    ``path`` when the block ends normally, removed if it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_open(path, mode: str = "w", fsync: bool = False):
    """``open`` a temp file next to ``path``; it replaces ``path`` when the block ends normally."""
    with atomic_path(path) as tmp, open(tmp, mode) as f:
        yield f
        if fsync:
            f.flush()
            os.fsync(f.fileno())


def atomic_write_text(path, text: str):
    with atomic_open(path, "w") as f:
        f.write(text)


def atomic_write_json(path, obj, indent: int = 2, sort_keys: bool = True):
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n")


def make_temp_dir(parent, prefix: str) -> Path:
    """A new empty folder in ``parent`` named ``{prefix}XXXX`` (mode 0777 less the umask)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    os.chmod(tmp, 0o777 & ~umask())
    return tmp


def replace_dir(src, dst):
    """Rename folder ``src`` to ``dst`` (same filesystem), replacing a folder already there."""
    src, dst = Path(src), Path(dst)
    if dst.exists():
        trash = Path(tempfile.mkdtemp(prefix=f".{dst.name}.old-", dir=dst.parent))
        os.replace(dst, trash / dst.name)
        os.replace(src, dst)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(src, dst)


@contextlib.contextmanager
def atomic_dir(path, prefix: str | None = None):
    """Yield a temp folder next to ``path`` to fill; it replaces ``path`` when the block ends normally and is
    removed if it raises."""
    path = Path(path)
    tmp = make_temp_dir(path.parent, prefix if prefix is not None else f".{path.name}.tmp-")
    try:
        yield tmp
        replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ---- reading the YAML configs -------------------------------------------------------------------------
# yaml.safe_load's loader, in C where libyaml is there (the same safe constructors, ~10x faster)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class ConfigError(ValueError):
    """A config problem, reported as one line naming the file, the key and what is expected."""


def read_yaml(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    with open(path) as f:
        data = yaml.load(f, Loader=SAFE_LOADER)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping at the top level")
    return data


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def dataclass_mapping(obj) -> dict:
    """A node of the experiment config's typed tree (stem.config.experiment) as the mapping the config writes (unset keys
    left out, a key written null kept)."""
    if dataclasses.is_dataclass(obj):
        written = getattr(obj, "_written", ())
        return {key_of(f, type(obj)): dataclass_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)
                if getattr(obj, f.name) is not None or f.name in written}
    if isinstance(obj, dict):
        return {k: dataclass_mapping(v) for k, v in obj.items()}
    if isinstance(obj, tuple):
        return [dataclass_mapping(v) for v in obj]
    return obj


def variants_file() -> dict:
    """config/variants.yaml as read, cached per version of the file; shared: read it, never change it (the typed
    nodes, with an experiment's variant_overrides: ``stem.specs.variants``)."""
    return _variants_file(str(VARIANTS), VARIANTS.stat().st_mtime_ns)


@lru_cache(maxsize=1)
def _variants_file(path: str, mtime_ns: int) -> dict:
    return read_yaml(path)
