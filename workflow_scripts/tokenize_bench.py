"""Tokenize throughput: tokens/s per core of the tokenize stage (read, encode, write shards) on the first
documents of a source, and the wall time it projects for a token count over scattered jobs.

    python -m workflow_scripts.tokenize_bench --tokenizer data/tiny/1b/tokenizer/tokenizer.json \
        --spec '{"kind": "files", "paths": ["data/tiny/corpus/web.jsonl"], "format": "jsonl"}' \
        --threads 1 --project 1.05e12 --jobs 1024 --cpus 8
"""
import argparse
import json
import tempfile
import time
from itertools import islice

# Deliberately lazy: main() parses and checks its arguments before it imports the code it runs, so a bad
# argument fails in one line before torch (or any other heavy module) loads.


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--spec", required=True, help="documents spec (JSON), as a source of the config")
    p.add_argument("--docs", type=int, default=20000, help="documents to tokenize")
    p.add_argument("--threads", type=int, default=1, help="encoder threads (cores)")
    p.add_argument("--project", type=float, help="tokens to produce: print the projected wall time")
    p.add_argument("--jobs", type=int, default=1, help="scattered jobs running at once")
    p.add_argument("--cpus", type=int, default=1, help="cores per job")
    args = p.parse_args()
    from stem.data.shards import tokenize_to_shards
    from stem.data.sources import iter_documents
    from stem.data.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    docs = list(islice(iter_documents(json.loads(args.spec)), args.docs))  # read first: time the encode+write
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        m = tokenize_to_shards(iter(docs), tok, f"{tmp}/out", num_workers=args.threads)
        dt = time.perf_counter() - t0
    tokens = sum(s["tokens"] for s in m["splits"].values())
    per_core = tokens / dt / args.threads
    print(f"{len(docs)} documents, {tokens} tokens in {dt:.2f} s: {tokens / dt:,.0f} tokens/s, "
          f"{per_core:,.0f} tokens/s per core ({args.threads} threads, vocab {tok.vocab_size})")
    if args.project:
        hours = args.project / (per_core * args.cpus * args.jobs) / 3600
        print(f"projected: {args.project:.3g} tokens over {args.jobs} jobs x {args.cpus} cores: {hours:.2f} h wall")


if __name__ == "__main__":
    main()
