"""Gather the scattered tokenize parts of one source into its manifest (reads JSON only; no torch)."""
import argparse
import sys

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True, help="the source's token directory (manifest.json is written there)")
    p.add_argument("parts", nargs="+", help="the part directories, in order")
    args = p.parse_args()
    from stem.data.shards import gather_parts
    try:
        m = gather_parts(args.out, args.parts)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print({s: m["splits"][s]["tokens"] for s in m["splits"]}, f"{len(m['parts'])} parts")


if __name__ == "__main__":
    main()
