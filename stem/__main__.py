"""Command line: python -m stem {params,bench,train} ..."""
from __future__ import annotations

import argparse
import json
import sys

from stem import config as C


def experiment_config(name: str) -> dict:
    path = C.REPO / "config" / f"{name}.yaml"
    if not path.is_file():
        raise C.ConfigError(f"experiment {name!r}: {path} not found (expected tiny or paper)")
    return C.load_experiment(path)


def cmd_params(args):
    from stem.report.params import accounting_for, accounting_rows, to_markdown
    cfg = experiment_config(args.experiment)
    if args.scale or args.variant:
        if not (args.scale and args.variant):
            raise C.ConfigError("--scale and --variant go together")
        out = accounting_for(cfg, args.scale, args.variant)
        print(json.dumps(out, indent=2) if args.json else out)
        return
    rows = accounting_rows(cfg)
    print(json.dumps(rows, indent=2) if args.json else to_markdown(rows, f"Parameter accounting, experiment '{args.experiment}'"))


def cmd_bench(args):
    from stem import bench
    bench.main_attention(args) if args.what == "attention" else bench.main(args)


def cmd_train(args):
    from stem.train.loop import train
    cfg = experiment_config(args.experiment)
    print(json.dumps(train(C.train_spec(cfg, args.scale, args.variant, args.stage), threads=args.threads), indent=2))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m stem", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    q = sub.add_parser("params", help="parameter / FLOP accounting")
    q.add_argument("--experiment", default="paper")
    q.add_argument("--scale")
    q.add_argument("--variant")
    q.add_argument("--json", action="store_true")
    q.set_defaults(fn=cmd_params)
    b = sub.add_parser("bench", help="benchmarks that print figures")
    b.add_argument("what", choices=["ffn", "attention"])
    b.add_argument("--scale", default="350m")
    b.add_argument("--tokens", type=int, default=2048)
    b.add_argument("--repeats", type=int, default=5)
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--device", default="cpu")
    b.set_defaults(fn=cmd_bench)
    t = sub.add_parser("train", help="train one job of an experiment (outside the workflow)")
    t.add_argument("--experiment", default="tiny")
    t.add_argument("--scale", required=True)
    t.add_argument("--variant", required=True)
    t.add_argument("--stage", default="pretrain")
    t.add_argument("--threads", type=int)
    t.set_defaults(fn=cmd_train)
    args = p.parse_args(argv)
    try:
        args.fn(args)
    except (C.ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
