"""Run one analysis (stem.analysis) on one checkpoint; spec resolved by the workflow from config `analysis:`."""
from workflow_scripts._entry import checkpoint_parser, run, set_threads, spec_of

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = checkpoint_parser(__doc__)
    args = p.parse_args()
    set_threads(args.threads)
    from stem.analysis.run import analyze
    r = analyze(args.checkpoint, spec_of(args), args.out)
    print(f"{r['analysis']}: {args.out} written in {r['wall_seconds']:.1f} s")


if __name__ == "__main__":
    run(main)
