"""Texts a dense checkpoint writes about the entities of a facts file (stem.train.entity_text; rule entity_text)."""
from stem.cli_args import whole
from workflow_scripts._entry import parser, run, spec_of

# Deliberately lazy, as workflow_scripts/analyze.py: a bad argument fails in one line before torch loads.


def main():
    p = parser(__doc__)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--threads", type=whole(1, "CPU threads"), default=None)
    args = p.parse_args()
    import torch
    if args.threads:
        torch.set_num_threads(args.threads)
    from stem.train.entity_text import generate
    r = generate(args.checkpoint, spec_of(args), args.out)
    print(f"entity texts: {args.out}: {len(r['texts'])} texts, {r['tokens']:,} tokens ({r['generated_tokens']:,} "
          f"generated) about {r['entities']} entities in {r['cpu_seconds']} CPU-s")


if __name__ == "__main__":
    run(main)
