"""Tokenize one source into train/val token shards with a manifest."""
from stem.cli_args import whole
from workflow_scripts._entry import parser, run, spec_of

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=whole(1, "CPU threads"), default=2)
    args = p.parse_args()
    from stem.pipeline import tokenize
    m = tokenize(spec_of(args), args.tokenizer, args.out, workers=args.threads)
    print({k: m[k] for k in ("vocab_size", "dtype")}, {s: m["splits"][s]["tokens"] for s in m["splits"]})


if __name__ == "__main__":
    run(main)
