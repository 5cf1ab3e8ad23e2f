"""Texts a dense checkpoint writes about the entities of a facts file (stem.train.entity_text; rule entity_text)."""
from workflow_scripts._entry import checkpoint_parser, run, set_threads, spec_of

# Deliberately lazy, as workflow_scripts/analyze.py: a bad argument fails in one line before torch loads.


def main():
    p = checkpoint_parser(__doc__)
    args = p.parse_args()
    set_threads(args.threads)
    from stem.train.entity_text import generate
    r = generate(args.checkpoint, spec_of(args), args.out)
    print(f"entity texts: {args.out}: {len(r['texts'])} texts, {r['tokens']:,} tokens ({r['generated_tokens']:,} "
          f"generated) about {r['entities']} entities in {r['cpu_seconds']} CPU-s")


if __name__ == "__main__":
    run(main)
