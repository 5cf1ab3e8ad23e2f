"""The command-line arguments of ``python -m stem`` and of the workflow's entry points (workflow_scripts), typed
in one place: each value is checked as it is parsed, and a bad one is one line naming the argument, the value and
what is expected (``error: python -m stem memory: argument --gpus: 0: expected a whole number >= 1 (...)``),
exit status 1, before anything runs. Torch-free."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stem.io import ConfigError
from stem.layout import REPO
from stem.options import Experiment, Scale, Stage, values

EXPERIMENTS = values(Experiment)


class OneLineParser(argparse.ArgumentParser):
    """argparse with the project's error format: one line on stderr (no usage block), exit status 1."""

    def error(self, message):
        print(f"error: {self.prog}: {message}", file=sys.stderr)
        sys.exit(1)


def whole(minimum: int, what: str):
    """An int >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"{text}: expected a whole number >= {minimum} ({what})")
        return value
    parse.__name__ = "whole number"
    return parse


def number(minimum: float, what: str):
    """A float >= ``minimum`` (finite)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not value >= minimum or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{text}: expected a number >= {minimum:g} ({what})")
        return value
    parse.__name__ = "number"
    return parse


def _unit_interval(what: str, name: str, top_included: bool, expected: str):
    """A float in (0, 1], or in (0, 1) where ``top_included`` is False."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = None
        if value is None or not (0 < value <= 1 if top_included else 0 < value < 1):
            raise argparse.ArgumentTypeError(f"{text}: expected {expected} ({what})")
        return value
    parse.__name__ = name
    return parse


def fraction(what: str):
    """A float in (0, 1]."""
    return _unit_interval(what, "fraction", True, "a fraction in (0, 1]")


def open_fraction(what: str):
    """A float in (0, 1), both ends excluded."""
    return _unit_interval(what, "open_fraction", False, "a number in (0, 1)")


def one_of(names, what: str):
    """One of ``names`` (the message names them all)."""
    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"{what} {text!r}: expected one of {', '.join(names)}")
        return text
    parse.__name__ = what
    return parse


scale = one_of(values(Scale), "scale")
stage = one_of(values(Stage), "stage")


def experiment(text: str) -> str:
    """An experiment name (config/{name}.yaml) or the path of an experiment YAML, which must exist."""
    if text in EXPERIMENTS or Path(text).is_file():
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: no such experiment config file; expected {', '.join(EXPERIMENTS)} "
                                     "(config/{name}.yaml) or the path of an experiment YAML")


def experiment_path(name: str) -> Path:
    """config/{name}.yaml for a name, else the path itself."""
    path = REPO / "config" / f"{name}.yaml" if name in EXPERIMENTS else Path(name)
    if not path.is_file():
        raise ConfigError(f"experiment {name!r}: {path} not found (expected {', '.join(EXPERIMENTS)} or the path of "
                          "an experiment YAML)")
    return path


def add_experiment(p: argparse.ArgumentParser, default: str, help: str | None = None):
    """``--experiment`` (alias ``--config``): a name or a YAML path."""
    p.add_argument("--experiment", "--config", dest="experiment", type=experiment, default=default,
                   help=help or f"tiny, paper or the path of an experiment YAML (default {default})")
