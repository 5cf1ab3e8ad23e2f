"""Suite kinds by name: one registered runner per ``kind`` of an eval suite (config
``eval.suites.{suite}.kind``). The runners register themselves in stem.eval.run with ``@suite_kind``; this
module imports nothing of the project, so the config check (stem.config) can name the kinds without an
import cycle (stem.eval.run reads the config's layout helpers)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

BUILTIN = ("lm_eval", "niah", "ppl")   # registered when stem.eval.run is imported


@dataclass(frozen=True)
class SuiteKind:
    """How a kind of suite runs: ``run(lm, spec, limit) -> (result fields, raw output, harness label)``;
    ``resolve(cfg, spec)`` completes the suite's spec from the experiment config (in place); ``inputs(cfg,
    spec)`` are the files its eval job reads besides the checkpoint (rules/eval.smk)."""
    run: Callable[..., tuple[dict, dict, str]]
    resolve: Callable[[dict, dict], None] | None = None
    inputs: Callable[[dict, dict], dict] | None = None


SUITE_KINDS: dict[str, SuiteKind] = {}


def suite_kind(name: str, resolve=None, inputs=None):
    """Decorator: register ``run`` as the runner of suite kind ``name``."""
    def register(run):
        if name in SUITE_KINDS:
            raise ValueError(f"suite kind {name!r}: already registered ({SUITE_KINDS[name].run.__qualname__})")
        SUITE_KINDS[name] = SuiteKind(run, resolve, inputs)
        return run
    return register


def known_kinds() -> list[str]:
    return sorted(set(BUILTIN) | set(SUITE_KINDS))
