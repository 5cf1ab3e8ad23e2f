"""Evaluate one checkpoint on one suite (spec resolved by the workflow from config `eval.suites`)."""
from workflow_scripts._entry import checkpoint_parser, run, set_threads, spec_of

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = checkpoint_parser(__doc__)
    p.add_argument("--raw", required=True)
    p.add_argument("--limit", type=int, default=None)
    args = p.parse_args()
    set_threads(args.threads)
    from stem.eval.run import evaluate
    spec = spec_of(args)
    r = evaluate(args.checkpoint, spec, args.out, args.raw, limit=args.limit, device=spec.get("device"))
    scores = {t: round(v["value"], 2) for t, v in r["tasks"].items() if v["value"] is not None}
    print(f"{spec['suite']}: scores {scores}; wall time {r['wall_seconds']:.1f} s")


if __name__ == "__main__":
    run(main)
