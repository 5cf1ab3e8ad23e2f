"""Generate a synthetic source corpus (jsonl) for the embedded default."""
from workflow_scripts._entry import parser, run, spec_of

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from stem.pipeline import make_corpus
    print(make_corpus(spec_of(args), args.out))


if __name__ == "__main__":
    run(main)
