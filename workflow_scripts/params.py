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
    from stem.report.params import COLUMNS, accounted, accounting_rows, to_markdown
    from stem.io import atomic_write_text
    acct = accounted(spec_of(args), "--spec")   # the job's part of the config: experiment, archs, variant_overrides
    rows = accounting_rows(acct)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(args.csv, buf.getvalue())
    atomic_write_text(args.md, to_markdown(rows, f"Parameter accounting, experiment '{acct.experiment}'"))


if __name__ == "__main__":
    run(main)
