"""Generate a synthetic source corpus (jsonl) for the embedded default."""
from workflow_scripts._entry import parser, run, spec_of


def main():
    p = parser(__doc__)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from stem.pipeline import make_corpus
    print(make_corpus(spec_of(args), args.out))


if __name__ == "__main__":
    run(main)
