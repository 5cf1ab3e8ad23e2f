"""Assemble reports/{experiment}/README.md from the tables, the diff and the figures."""
from workflow_scripts._entry import parser, run, spec_of


def main():
    p = parser(__doc__)
    p.add_argument("--report-dir", required=True)
    p.add_argument("--figures", nargs="*", default=[])
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from stem.report.build import readme
    from stem.io import atomic_write_text
    atomic_write_text(args.out, readme(spec_of(args), args.report_dir, args.figures))


if __name__ == "__main__":
    run(main)
