"""Tokenize stage: sources, BPE tokenizer, token shards."""

import gzip
import json
import os
import random

import numpy as np
import pytest

from stem.data.shards import ShardSet, choose_dtype, tokenize_to_shards, val_mask
from stem.data.sources import iter_documents
from stem.data.tokenizer import load_tokenizer, train_bpe


def make_corpus(n_docs=300, seed=0):
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyzé"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(1, 9))) for _ in range(400)]
    words += ["ünïcödé", "日本語", "tab\there", "<|endoftext|>", "12,345.6!"]
    docs = []
    for _ in range(n_docs):
        lines = [" ".join(rng.choice(words) for _ in range(rng.randint(1, 15))) for _ in range(rng.randint(1, 4))]
        docs.append("\n".join(lines))
    return docs


@pytest.fixture(scope="module")
def corpus():
    return make_corpus()


@pytest.fixture(scope="module")
def tok_path(corpus, tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    train_bpe(corpus, 400, path)
    return path


@pytest.fixture(scope="module")
def tok(tok_path):
    return load_tokenizer(tok_path)


def read_docs(out_dir, split, tok):
    ss = ShardSet(out_dir, split)
    tokens = ss.get(0, ss.tokens)
    bounds = list(ss.doc_starts) + [ss.tokens]
    docs = []
    for a, b in zip(bounds, bounds[1:]):
        assert tokens[b - 1] == tok.eos_id
        assert tok.eos_id not in tokens[a : b - 1]
        docs.append(tok.decode(tokens[a : b - 1]))
    return docs


# ----------------------------------------------------------------------------- tokenizer


def test_train_and_load_tokenizer(tok_path, tok, tmp_path):
    assert tok.vocab_size == 400
    assert tok.eos_id == 0  # first special token
    assert tok.path == str(tok_path)
    assert not list(tmp_path.iterdir())  # no temp files left by the atomic save
    text = "hello wörld <|endoftext|> 日本語"
    assert tok.decode(tok.encode_batch([text])[0]) == text
    from_dir = load_tokenizer(tok_path.parent)
    assert from_dir.encode_batch(["abc def"]) == tok.encode_batch(["abc def"])
    assert from_dir.sha256 == tok.sha256


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "nope" / "tokenizer.json")
    with pytest.raises(ValueError, match="has no tokenizer.json"):
        load_tokenizer(tmp_path)


def test_train_bpe_into_directory_and_eos_check(corpus, tmp_path):
    train_bpe(corpus[:50], 300, tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="no EOS"):
        train_bpe(corpus[:50], 300, tmp_path / "x.json", special_tokens=("<|pad|>",))
    with pytest.raises(ValueError, match="too small"):
        train_bpe(corpus[:50], 100, tmp_path / "x.json")


# ----------------------------------------------------------------------------- shards


def test_round_trip_several_shards(corpus, tok, tmp_path):
    out = tmp_path / "shards"
    m = tokenize_to_shards(iter(corpus), tok, out, shard_tokens=500, val_fraction=0.1, batch_docs=32, source={"kind": "test"})
    assert m["dtype"] == "uint16" and m["eos_id"] == tok.eos_id and m["vocab_size"] == 400
    assert m["source"] == {"kind": "test"} and m["created_by"] == "stem.data.shards"
    assert m["tokenizer_sha256"] == tok.sha256
    assert len(m["splits"]["train"]["shards"]) > 3
    assert json.loads((out / "manifest.json").read_text()) == m

    train, val = read_docs(out, "train", tok), read_docs(out, "val", tok)
    is_val = val_mask(np.arange(len(corpus)), 0.1, 0)
    assert train == [d for d, v in zip(corpus, is_val) if not v]
    assert val == [d for d, v in zip(corpus, is_val) if v]

    ss = ShardSet(out, "train")
    assert ss.out_dir == out
    assert ss.num_documents == len(train) == m["splits"]["train"]["documents"]
    assert ss.tokens == m["splits"]["train"]["tokens"]
    for s in m["splits"]["train"]["shards"][:-1]:
        assert s["tokens"] == 500  # fixed-size shards
        assert (out / s["file"]).stat().st_size == 500 * 2
    # a read across a shard boundary equals the concatenation
    whole = ss.get(0, ss.tokens)
    assert np.array_equal(ss.get(450, 600), whole[450:1050])
    with pytest.raises(IndexError):
        ss.get(ss.tokens - 5, 10)
    assert ss.verify()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # temp dir renamed away


def test_verify_detects_corruption(corpus, tok, tmp_path):
    out = tmp_path / "shards"
    tokenize_to_shards(iter(corpus[:50]), tok, out, shard_tokens=300)
    path = out / "train_00001.bin"
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256 mismatch"):
        ShardSet(out, "train").verify()


def test_dtype_choice(tok):
    assert choose_dtype("auto", 400) == np.uint16
    assert choose_dtype("auto", 65536) == np.uint16
    assert choose_dtype("auto", 65537) == np.uint32
    assert choose_dtype("uint32", 400) == np.uint32
    with pytest.raises(ValueError, match="uint16 cannot hold vocab_size 100000"):
        choose_dtype("uint16", 100_000)
    with pytest.raises(ValueError, match="not supported"):
        choose_dtype("int8", 100)


def test_uint32_shards_and_too_small_dtype(corpus, tok, tmp_path):
    m = tokenize_to_shards(iter(corpus[:40]), tok, tmp_path / "a", dtype="uint32", val_fraction=0.0)
    assert m["dtype"] == "uint32"
    assert read_docs(tmp_path / "a", "train", tok) == corpus[:40]

    class BigVocab:  # a tokenizer whose vocabulary does not fit uint16
        vocab_size, eos_id, sha256, source = 70_000, 0, None, None

        def encode_batch(self, texts):
            return [[69_999] * 3 for _ in texts]

    m = tokenize_to_shards(iter(["x", "y"]), BigVocab(), tmp_path / "b", val_fraction=0.0)
    assert m["dtype"] == "uint32"
    assert list(ShardSet(tmp_path / "b", "train").get(0, 8)) == [69_999] * 3 + [0] + [69_999] * 3 + [0]
    with pytest.raises(ValueError, match="70000"):
        tokenize_to_shards(iter(["x"]), BigVocab(), tmp_path / "c", dtype="uint16")
    assert not (tmp_path / "c").exists()


def test_empty_corpus(tok, tmp_path):
    for docs in ([], ["", ""]):
        with pytest.raises(ValueError, match="empty corpus"):
            tokenize_to_shards(iter(docs), tok, tmp_path / "out")
        assert not os.listdir(tmp_path)


def test_val_split_deterministic(corpus, tok, tmp_path):
    m1 = tokenize_to_shards(iter(corpus), tok, tmp_path / "a", val_fraction=0.1, seed=3)
    m2 = tokenize_to_shards(iter(corpus), tok, tmp_path / "b", val_fraction=0.1, seed=3, batch_docs=7)
    assert m1["splits"] == m2["splits"]
    n_val = m1["splits"]["val"]["documents"]
    assert 10 <= n_val <= 60  # ~30 expected out of 300
    assert not np.array_equal(val_mask(np.arange(300), 0.1, 3), val_mask(np.arange(300), 0.1, 4))
    frac = val_mask(np.arange(100_000), 0.01, 0).mean()
    assert 0.008 < frac < 0.012


def test_max_tokens(corpus, tok, tmp_path):
    m = tokenize_to_shards(iter(corpus), tok, tmp_path / "out", max_tokens=1234, shard_tokens=100, batch_docs=16)
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == 1234
    assert m["truncated"]


def test_failure_leaves_no_out_dir(corpus, tok, tmp_path):
    def failing():
        for i, doc in enumerate(corpus):
            if i == 150:
                raise RuntimeError("source died")
            yield doc

    out = tmp_path / "shards"
    with pytest.raises(RuntimeError, match="source died"):
        tokenize_to_shards(failing(), tok, out, shard_tokens=200, batch_docs=16)
    assert not os.listdir(tmp_path)  # neither out_dir nor the temp dir
    # an existing out_dir survives a failed rebuild untouched
    tokenize_to_shards(iter(corpus[:20]), tok, out)
    before = (out / "manifest.json").read_text()
    with pytest.raises(RuntimeError):
        tokenize_to_shards(failing(), tok, out, batch_docs=16)
    assert (out / "manifest.json").read_text() == before
    assert os.listdir(tmp_path) == ["shards"]


def test_shardset_manifest_errors(corpus, tok, tmp_path):
    with pytest.raises(ValueError, match="manifest.json does not exist"):
        ShardSet(tmp_path, "train")
    out = tmp_path / "shards"
    tokenize_to_shards(iter(corpus[:20]), tok, out)
    with pytest.raises(ValueError, match="no split 'test'"):
        ShardSet(out, "test")
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json is corrupt"):
        ShardSet(out, "train")
    (out / "manifest.json").write_text(json.dumps({"created_by": "stem.data.shards", "dtype": "uint16"}))
    with pytest.raises(ValueError, match="manifest.json is invalid"):
        ShardSet(out, "train")


# ----------------------------------------------------------------------------- sources


def test_jsonl_and_gz_sources(tmp_path):
    docs = ["first doc", "second\ndoc", "ünïcödé"]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps({"body": d, "id": i}) for i, d in enumerate(docs[:2])) + "\n\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(json.dumps({"body": docs[2]}) + "\n")
    spec = {"kind": "files", "paths": [str(tmp_path / "*.jsonl*")], "format": "jsonl", "text_field": "body"}
    assert list(iter_documents(spec)) == docs
    with pytest.raises(ValueError, match=r"a.jsonl:1: missing text_field 'text'"):
        list(iter_documents({**spec, "text_field": "text"}))


def test_text_sources(tmp_path):
    (tmp_path / "one.txt").write_text("whole file\n\nis one doc")
    with gzip.open(tmp_path / "two.txt.gz", "wt", encoding="utf-8") as f:
        f.write("a\n\nb\n\nc")
    spec = {"kind": "files", "paths": [str(tmp_path / "one.txt")], "format": "text"}
    assert list(iter_documents(spec)) == ["whole file\n\nis one doc"]
    spec = {"kind": "files", "paths": [str(tmp_path / "two.txt.gz")], "format": "text", "doc_separator": "\n\n"}
    assert list(iter_documents(spec)) == ["a", "b", "c"]


def test_parquet_source(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"doc {i}" for i in range(25)]
    pq.write_table(pa.table({"text": texts, "n": list(range(25))}), tmp_path / "d.parquet", row_group_size=10)
    spec = {"kind": "files", "paths": [str(tmp_path / "d.parquet")], "format": "parquet"}
    assert list(iter_documents(spec)) == texts
    with pytest.raises(ValueError, match=r"d.parquet: missing text_field 'content'"):
        list(iter_documents({**spec, "text_field": "content"}))


def test_source_spec_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown kind 'ftp'"):
        iter_documents({"kind": "ftp"})
    with pytest.raises(ValueError, match="matches no file"):
        iter_documents({"kind": "files", "paths": [str(tmp_path / "*.jsonl")], "format": "jsonl"})
    with pytest.raises(ValueError, match="format 'csv' is not supported"):
        iter_documents({"kind": "files", "paths": [str(tmp_path)], "format": "csv"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['text_feild'\]"):
        iter_documents({"kind": "files", "paths": ["x"], "format": "jsonl", "text_feild": "t"})
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: field 'text' is int"):
        list(iter_documents({"kind": "files", "paths": [str(tmp_path / "bad.jsonl")], "format": "jsonl"}))


def test_sources_feed_tokenizer_end_to_end(corpus, tok, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(src / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        for d in corpus[:60]:
            f.write(json.dumps({"text": d}) + "\n")
    spec = {"kind": "files", "paths": [str(src / "*.jsonl.gz")], "format": "jsonl"}
    m = tokenize_to_shards(iter_documents(spec), tok, tmp_path / "out", val_fraction=0.0, source=spec)
    assert m["source"] == spec
    assert read_docs(tmp_path / "out", "train", tok) == corpus[:60]
    assert m["splits"]["val"] == {"tokens": 0, "documents": 0, "shards": []}
    assert ShardSet(tmp_path / "out", "val").tokens == 0


def test_hf_source_streams_a_real_local_dataset(tmp_path):
    """The hub reader on a local folder (datasets' own json builder, streaming): data_files, the
    format check against the builder, and a record without the text field."""
    pytest.importorskip("datasets")
    (tmp_path / "x").mkdir()
    with gzip.open(tmp_path / "x" / "a.json.gz", "wt") as f:
        f.write('{"text": "a"}\n{"text": "b"}\n{"text": 3}\n')
    spec = {"kind": "hf", "path": str(tmp_path), "name": None, "split": "train", "text_field": "text",
            "data_files": ["x/*.json.gz"], "format": "json"}
    docs = iter_documents(spec)
    assert [next(docs), next(docs)] == ["a", "b"]
    with pytest.raises(ValueError, match="record 2: field 'text' is not a string"):
        next(docs)
    with pytest.raises(ValueError, match="its files are 'json' but the source spec says format 'parquet'"):
        next(iter_documents({**spec, "format": "parquet"}))
    with pytest.raises(ValueError, match="no text_field 'body'; columns are"):
        next(iter_documents({**spec, "text_field": "body"}))


# ----------------------------------------------------------------------------- nothing wrong passes silently


@pytest.mark.parametrize("content", [b"", b"\n\n", b'{"text": ""}\n{"text": "  "}\n'])
def test_empty_source_is_an_error_naming_the_file(tmp_path, content):
    """Issue 16.4: an empty web.jsonl must not let the tokenizer train on the other sources without a word."""
    from stem.pipeline import make_tokenizer, tokenize
    (tmp_path / "web.jsonl").write_bytes(content)
    (tmp_path / "math.jsonl").write_text("".join(json.dumps({"text": f"1 + {i} = {1 + i}"}) + "\n" for i in range(50)))
    docs = [{"kind": "files", "paths": [str(tmp_path / f"{s}.jsonl")], "format": "jsonl"} for s in ("web", "math")]
    message = f"{tmp_path / 'web.jsonl'}: no documents (an empty source)"
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")):
        make_tokenizer({"kind": "train_bpe", "vocab_size": 300, "documents": docs}, tmp_path / "tok.json")
    assert not (tmp_path / "tok.json").exists()
    make_tokenizer({"kind": "train_bpe", "vocab_size": 300, "documents": docs[1:]}, tmp_path / "tok.json")
    with pytest.raises(ValueError, match="web.jsonl: no documents"):
        tokenize({"documents": docs[0], "seed": 0, "vocab_size": 300, "max_tokens": None}, tmp_path / "tok.json",
                 tmp_path / "tokens")
    assert not (tmp_path / "tokens").exists()
    (tmp_path / "empty.txt").write_bytes(b" \n")
    with pytest.raises(ValueError, match="empty.txt: no documents"):
        list(iter_documents({"kind": "files", "paths": [str(tmp_path / "empty.txt")], "format": "text"}))


@pytest.mark.parametrize("name, fmt, sep", [("bad.jsonl", "jsonl", None), ("bad.jsonl.gz", "jsonl", None),
                                            ("bad.txt", "text", "\n\n"), ("bad.txt", "text", None)])
def test_non_utf8_input_names_the_file_and_line(tmp_path, name, fmt, sep):
    """Issue 16.8: today a bare UnicodeDecodeError with neither file nor line."""
    if fmt == "jsonl":
        lines = [json.dumps({"text": "fine"}), json.dumps({"text": "ünïcödé"}), '{"text": "caf\xe9"}']
    else:
        lines = ["fine", "", "ünïcödé", "caf\xe9"]
    raw = "\n".join(lines).encode("utf-8").replace("caf\xc3\xa9".encode("latin-1"), b"caf\xe9")  # latin-1 é
    path = tmp_path / name
    path.write_bytes(gzip.compress(raw) if name.endswith(".gz") else raw)
    spec = {"kind": "files", "paths": [str(path)], "format": fmt, **({"doc_separator": sep} if sep else {})}
    with pytest.raises(ValueError) as e:
        list(iter_documents(spec))
    assert str(e.value) == (f"{path}:{len(lines)}: not valid UTF-8 (byte 0xe9 at column {lines[-1].index('caf') + 4}); "
                            "expected UTF-8 text")


def _corrupt_in_place(path, index, value, dtype):
    """Overwrite one token of a shard file, keeping its size (as a disk or copy error would)."""
    data = np.fromfile(path, dtype=dtype)
    data[index] = value
    data.tofile(path)


def test_shard_corrupted_in_place_stops_the_loader_with_one_line(corpus, tok, tmp_path):
    """Issue 16.8: same size, so the open-time size check passes; the checksum on first read catches it."""
    from stem.data.loader import MixtureLoader
    out = tmp_path / "shards"
    m = tokenize_to_shards(iter(corpus[:80]), tok, out, shard_tokens=300, val_fraction=0.0)
    path = out / "train_00001.bin"
    old = np.fromfile(path, dtype=m["dtype"])[7]
    _corrupt_in_place(path, 7, (int(old) + 1) % 100, m["dtype"])  # a valid id: only the checksum sees it
    loader = MixtureLoader({"web": (ShardSet(out, "train"), 1.0)}, seq_len=16, micro_batch=4, seed=0)
    with pytest.raises(ValueError) as e:
        for _ in range(200):
            loader.next_batch()
    assert str(e.value).startswith(f"shard {path}: sha256 mismatch") and "\n" not in str(e.value)
    ss = ShardSet(out, "train")
    ss.get(0, 10)
    assert ss._verified == {0}  # lazily: only the shards read so far


def test_token_id_beyond_vocab_is_one_line_naming_the_shard(corpus, tok, tmp_path, monkeypatch):
    """Today an IndexError deep in the model's embedding; with checksums off (STEM_SHARD_CHECKSUMS=0) the
    always-on id check still names the shard and the token."""
    from stem.data.loader import MixtureLoader, validation_batches
    out = tmp_path / "shards"
    m = tokenize_to_shards(iter(corpus[:80]), tok, out, shard_tokens=300, val_fraction=0.0)
    path = out / "train_00002.bin"
    _corrupt_in_place(path, 11, tok.vocab_size, m["dtype"])
    monkeypatch.setenv("STEM_SHARD_CHECKSUMS", "0")
    expected = (f"shard {path}: token id {tok.vocab_size} at token 11 is not below the manifest's vocab_size "
                f"{tok.vocab_size} (corrupt shard, or shards of another tokenizer)")
    loader = MixtureLoader({"web": (ShardSet(out, "train"), 1.0)}, seq_len=16, micro_batch=4, seed=0)
    with pytest.raises(ValueError) as e:
        for _ in range(200):
            loader.next_batch()
    assert str(e.value) == expected
    with pytest.raises(ValueError) as e:
        validation_batches({"web": ShardSet(out, "train")}, 16, 4, 20)
    assert str(e.value) == expected


def test_blank_hf_dataset_is_an_error(tmp_path, monkeypatch):
    """The real datasets streaming reader on a local file (the 'json' builder: no network)."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": " "}\n')
    with pytest.raises(ValueError, match="hf dataset 'json': no documents"):
        list(iter_documents({"kind": "hf", "path": "json", "format": "json",
                            "data_files": [str(tmp_path / "blank.jsonl")]}))
