"""Evaluate one checkpoint on one suite (spec resolved by the workflow from config `eval.suites`)."""
from stem.cli_args import whole
from workflow_scripts._entry import parser, run, spec_of

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--raw", required=True)
    p.add_argument("--threads", type=whole(1, "CPU threads"), default=None)
    p.add_argument("--limit", type=int, default=None)
    args = p.parse_args()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from stem.eval.run import evaluate
    spec = spec_of(args)
    r = evaluate(args.checkpoint, spec, args.out, args.raw, limit=args.limit, device=spec.get("device"))
    scores = {t: round(v["value"], 2) for t, v in r["tasks"].items() if v["value"] is not None}
    print(f"{spec['suite']}: scores {scores}; wall time {r['wall_seconds']:.1f} s")


if __name__ == "__main__":
    run(main)
