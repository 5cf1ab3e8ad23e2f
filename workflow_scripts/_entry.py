"""Shared plumbing of the thin entry points: JSON spec argument, one-line errors, non-zero exit."""
from __future__ import annotations

import argparse
import json
import sys


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--spec", required=True, help="the job spec as JSON (resolved by the workflow)")
    return p


def run(main):
    """Call main(); turn expected failures into one line on stderr and exit status 1."""
    try:
        main()
    except Exception as e:  # the error types are imported only on failure: stem.train.loop imports torch
        from stem.config import ConfigError
        from stem.train.loop import TrainingError

        if not isinstance(e, (ConfigError, TrainingError, ValueError, FileNotFoundError)):
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def spec_of(args) -> dict:
    return json.loads(args.spec)
