"""The bottom of the config layer: the repository, config/variants.yaml, YAML reading and the config error
(stem.config re-exports them; stem.sweeps uses them without importing stem.config, which imports it)."""
from __future__ import annotations

import copy
from functools import lru_cache
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
VARIANTS = REPO / "config" / "variants.yaml"


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


def variants(cfg: dict) -> dict:
    """config/variants.yaml with the experiment's ``variant_overrides`` merged over each variant."""
    base = _variants_file(VARIANTS.stat().st_mtime_ns)
    return {name: deep_merge(spec, cfg.get("variant_overrides", {}).get(name, {})) for name, spec in base.items()}


@lru_cache(maxsize=1)
def _variants_file(mtime_ns: int) -> dict:
    """config/variants.yaml, read once per version of the file (the DAG resolves hundreds of job specs);
    callers get deep copies through ``deep_merge``."""
    return read_yaml(VARIANTS)
