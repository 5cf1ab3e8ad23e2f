"""Generate the offline evaluation fixtures (task data + task YAMLs) from the synthetic world."""
from workflow_scripts._entry import parser, run, spec_of

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from stem.eval.fixtures import write_fixtures
    m = write_fixtures(spec_of(args), args.out)
    print(f"{len(m['tasks'])} tasks, {len(m['groups'])} groups -> {args.out}")


if __name__ == "__main__":
    run(main)
