"""Assemble reports/{experiment}/README.md (or, with --html, the self-contained report.html) from the tables,
the diff and the figures."""
from workflow_scripts._entry import experiment_of, parser, run

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--report-dir", required=True)
    p.add_argument("--figures", nargs="*", default=[])
    p.add_argument("--out", required=True)
    p.add_argument("--html", action="store_true", help="write the HTML report instead of the README")
    args = p.parse_args()
    from stem.report.build import html_report, readme
    from stem.io import atomic_write_text
    page = (html_report if args.html else readme)(experiment_of(args), args.report_dir, args.figures)
    atomic_write_text(args.out, page)


if __name__ == "__main__":
    run(main)
