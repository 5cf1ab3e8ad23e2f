"""Compare the reproduced tables with the paper's cells; write diff.md, CSVs and summary.json."""
from workflow_scripts._entry import experiment_of, parser, run

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--reproduced", required=True)
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()
    from stem.report.build import load_reproduced, paper_accounting, run_diff, write_diff
    exp = experiment_of(args)
    write_diff(exp, args.out_dir, *run_diff(exp, load_reproduced(args.reproduced), paper_acct=paper_accounting()))


if __name__ == "__main__":
    run(main)
