"""Train (or resume) one (scale, variant, stage) job.

The process stops (saving its state, exit 143) when its parent (the rule's shell, or torchrun) or the
Snakemake process named by $STEM_OWNER_PID (launch.py --owner-pid) dies: see stem/train/lifecycle.py.
"""
from stem.cli_args import whole
from workflow_scripts._entry import parser, run, spec_of

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    from stem.train import lifecycle
    lifecycle.catch_stop_signals()   # before the slow imports: a stop signal arriving now is kept
    p = parser(__doc__)
    p.add_argument("--threads", type=whole(1, "CPU threads"), default=None)
    args = p.parse_args()
    lifecycle.die_with_parent()
    lifecycle.watch_owner()
    from stem.train.loop import train
    s = train(spec_of(args), threads=args.threads)
    print({k: s[k] for k in ("final_train_loss", "final_val_loss", "steps", "wall_seconds")})


if __name__ == "__main__":
    run(main)
