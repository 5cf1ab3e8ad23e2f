"""Collect one DSE sweep (stem.sweeps: rho or slots) from its points' training summaries: JSON, Markdown, figure."""
from workflow_scripts._entry import parser, run, spec_of

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--kind", required=True, choices=["rho", "slots"])
    p.add_argument("--results", default="results")
    for ext in ("json", "md", "png", "pdf"):
        p.add_argument(f"--{ext}", required=True)
    args = p.parse_args()
    from stem.report import sweeps
    from stem.io import atomic_write_json, atomic_write_text
    from stem.report.figures import save
    r = sweeps.collect(spec_of(args), args.kind, args.results)
    save(sweeps.figure(r), args.png, args.pdf)
    atomic_write_text(args.md, sweeps.markdown(r))
    atomic_write_json(args.json, r)   # last: the rule's first output, complete only when the others are


if __name__ == "__main__":
    run(main)
