"""Gather the scattered tokenize parts of one source into its manifest."""
import argparse

from workflow_scripts._entry import run


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="the source's token directory (manifest.json is written there)")
    p.add_argument("parts", nargs="+", help="the part directories, in order")
    args = p.parse_args()
    from stem.pipeline import gather
    m = gather(args.parts, args.out)
    print({s: m["splits"][s]["tokens"] for s in m["splits"]}, f"{len(m['parts'])} parts")


if __name__ == "__main__":
    run(main)
