"""Run one analysis (stem.analysis) on one checkpoint; spec resolved by the workflow from config `analysis:`."""
from stem.cli_args import whole
from workflow_scripts._entry import parser, run, spec_of

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=whole(1, "CPU threads"), default=None)
    args = p.parse_args()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from stem.analysis.run import analyze
    r = analyze(args.checkpoint, spec_of(args), args.out)
    print(f"{r['analysis']}: {args.out} written in {r['wall_seconds']:.1f} s")


if __name__ == "__main__":
    run(main)
