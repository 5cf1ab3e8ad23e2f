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
    from stem.config import ConfigError
    from stem.train.loop import TrainingError

    try:
        main()
    except (ConfigError, TrainingError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def spec_of(args) -> dict:
    return json.loads(args.spec)
