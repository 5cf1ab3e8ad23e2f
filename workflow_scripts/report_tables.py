"""Build the paper's tables (1-6 and Figure 1b's data) from whatever results exist."""
from workflow_scripts._entry import experiment_of, parser, run

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--results", default="results")
    p.add_argument("--out-dir", required=True)
    args = p.parse_args()
    from stem.report.build import write_tables
    from stem.report.results import Results
    exp = experiment_of(args)
    write_tables(exp, Results(exp.experiment, args.results), args.out_dir)


if __name__ == "__main__":
    run(main)
