"""reports/{experiment}/analysis/: the analyze stage's tables, figures and directions (stem.analysis.report)."""
from workflow_scripts._entry import parser, run, spec_of


def main():
    p = parser(__doc__)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()
    from stem.analysis.report import build
    counts = build(spec_of(args), args.out_dir)
    print(f"analysis report: {args.out_dir}; directions {counts}")


if __name__ == "__main__":
    run(main)
