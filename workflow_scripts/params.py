"""Write the accounting table (CSV and Markdown) for every variant of every scale."""
import csv
import io

from workflow_scripts._entry import parser, run, spec_of

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--csv", required=True)
    p.add_argument("--md", required=True)
    args = p.parse_args()
    from stem.report.params import COLUMNS, accounting_rows, to_markdown
    from stem.io import atomic_write_text
    cfg = spec_of(args)
    rows = accounting_rows(cfg)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(args.csv, buf.getvalue())
    atomic_write_text(args.md, to_markdown(rows, f"Parameter accounting, experiment '{cfg['experiment']}'"))


if __name__ == "__main__":
    run(main)
