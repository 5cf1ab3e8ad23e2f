"""Shared plumbing of the thin entry points: JSON spec argument, one-line errors, non-zero exit."""
from __future__ import annotations

import argparse
import json
import sys

from stem import plugins
from stem.config import experiment
from stem.cli_args import OneLineParser, whole  # a bad argument: one line, exit 1 (torch-free)
from stem.config import ConfigError


def parser(description: str) -> argparse.ArgumentParser:
    p = OneLineParser(description=description)
    p.add_argument("--spec", required=True, help="the job spec as JSON (resolved by the workflow)")
    return p


def checkpoint_parser(description: str) -> argparse.ArgumentParser:
    """``parser`` with the arguments of a job that reads one checkpoint: --checkpoint, --out, --threads."""
    p = parser(description)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=whole(1, "CPU threads"), default=None)
    return p


def set_threads(threads: int | None):
    """Import torch (only once the arguments are checked: a bad one fails before it loads) and give it
    ``threads`` intra-op threads when set."""
    import torch   # heavy: after the arguments' check (see above)
    if threads:
        torch.set_num_threads(threads)


def run(main):
    """Call main(); turn expected failures into one line on stderr and exit status 1."""
    try:
        main()
    except Exception as e:
        from stem.train.loop import TrainingError   # only on failure: stem.train.loop imports torch

        # OSError names its file (a folder that cannot be created: FileExistsError, PermissionError, ...)
        if not isinstance(e, (ConfigError, TrainingError, ValueError, OSError)):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def spec_of(args) -> dict:
    try:
        spec = json.loads(args.spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"--spec: not valid JSON ({e.msg} at column {e.colno}); expected the job spec object") from None
    if not isinstance(spec, dict):
        raise ValueError(f"--spec: a JSON {type(spec).__name__}; expected the job spec object")
    plugins.load(spec.get("plugins"), origin="--spec: key 'plugins'")   # the config's own kinds, before any lookup
    return spec


def experiment_of(args):
    """``--spec`` as an experiment config (the report's jobs get the whole config): its typed tree, parsed once
    (stem.config.experiment; one ConfigError line ``--spec: key '...': ...`` otherwise)."""
    return experiment.parse(spec_of(args), origin="--spec")
