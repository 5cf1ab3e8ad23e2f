"""Benchmark the offload engine (STEM or DSE tables) on a checkpoint: JSON and the printed table (Markdown); the report draws
the hit-rate figure from the JSON (stem.report.figures: offload_hit_rate)."""
from workflow_scripts._entry import parser, run, spec_of

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = parser(__doc__)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--md", required=True)
    args = p.parse_args()
    import torch

    from stem.bench.offload import bench_offload, render
    from stem.io import atomic_write_json, atomic_write_text
    spec = spec_of(args)
    torch.set_num_threads(1)
    r = bench_offload(args.checkpoint, spec["batch"], spec["prompt"], spec["steps"], spec.get("cache_rows"),
                      repeats=spec["repeats"])
    text = render(r)  # the table `python -m stem bench offload` prints, kept as offload.md
    atomic_write_text(args.md, f"```\n{text}\n```\n")
    atomic_write_json(args.json, r)  # last: the rule's first output


if __name__ == "__main__":
    run(main)
