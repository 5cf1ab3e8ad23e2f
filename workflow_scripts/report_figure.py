"""Draw one figure of the report (PNG and PDF)."""
import json

from workflow_scripts._entry import experiment_of, parser, run

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--name", required=True)
    p.add_argument("--results", default="results")
    p.add_argument("--reproduced", required=True)
    p.add_argument("--files", default="{}", help="JSON {name: path or [paths]}: the figure's inputs (registry)")
    p.add_argument("--png", required=True)
    p.add_argument("--pdf", required=True)
    args = p.parse_args()
    from stem.report.build import load_reproduced
    from stem.report.figures import draw, save
    from stem.report.results import Results
    exp = experiment_of(args)
    save(draw(args.name, exp, Results(exp.experiment, args.results), load_reproduced(args.reproduced),
              json.loads(args.files)), args.png, args.pdf)


if __name__ == "__main__":
    run(main)
