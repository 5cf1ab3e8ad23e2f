"""Document sources for the tokenize stage.

A source is described by a plain dict (from the YAML config):

    {"kind": "files", "paths": ["data/raw/*.jsonl.gz"], "format": "jsonl", "text_field": "text"}
    {"kind": "files", "paths": ["books/*.txt"], "format": "text", "doc_separator": "\\n\\n"}
    {"kind": "files", "paths": ["shards/*.parquet"], "format": "parquet", "text_field": "text"}
    {"kind": "hf", "path": "allenai/olmo-mix-1124", "name": None, "split": "train",
     "text_field": "text", "data_files": None}

``iter_documents(spec)`` validates the spec eagerly (bad keys, unknown kind or
format, globs matching nothing raise ``ValueError`` right away) and returns a
lazy iterator of document strings. Empty documents are passed through; the
consumer decides what to do with them.
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import os
from typing import Iterator

FORMATS = ("jsonl", "text", "parquet")
_FILES_KEYS = {"kind", "paths", "format", "text_field", "doc_separator"}
_HF_KEYS = {"kind", "path", "name", "split", "text_field", "data_files", "revision"}


def iter_documents(spec: dict) -> Iterator[str]:
    """Return an iterator over the documents (str) described by ``spec``."""
    if not isinstance(spec, dict):
        raise ValueError(f"source spec must be a mapping, got {type(spec).__name__}: {spec!r}")
    kind = spec.get("kind")
    if kind == "files":
        _check_keys(spec, _FILES_KEYS)
        return _iter_files(spec)
    if kind == "hf":
        _check_keys(spec, _HF_KEYS)
        return _iter_hf(spec)
    raise ValueError(f"source spec: unknown kind {kind!r}; expected 'files' or 'hf'")


def _check_keys(spec: dict, allowed: set[str]) -> None:
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise ValueError(
            f"source spec (kind={spec['kind']!r}): unknown key(s) {unknown}; "
            f"expected a subset of {sorted(allowed)}"
        )


# ----------------------------------------------------------------------------- files


def _expand_paths(patterns) -> list[str]:
    if isinstance(patterns, str):
        patterns = [patterns]
    if not patterns or not isinstance(patterns, (list, tuple)):
        raise ValueError(f"source spec: 'paths' must be a non-empty list of globs, got {patterns!r}")
    files: list[str] = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
        if not matches:
            raise ValueError(f"source spec: path/glob {pattern!r} matches no file")
        files.extend(matches)
    return files


def _iter_files(spec: dict) -> Iterator[str]:
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
        if fmt == "parquet" and path.endswith(".gz"):
            raise ValueError(f"source spec: {path}: .gz is only supported for jsonl/text, not parquet")
    return _gen_files(files, fmt, text_field, sep)


def _gen_files(files, fmt, text_field, sep) -> Iterator[str]:
    for path in files:
        if fmt == "jsonl":
            docs = _read_jsonl(path, text_field)
        elif fmt == "text":
            docs = _read_text(path, sep)
        else:
            docs = _read_parquet(path, text_field)
        yield from _checked(path, docs)


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
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several types for bad files
        raise ValueError(f"{path}: cannot read as parquet ({e})") from None
    if text_field not in pf.schema_arrow.names:
        raise ValueError(f"{path}: missing text_field {text_field!r}; columns are {pf.schema_arrow.names}")
    for rg in range(pf.num_row_groups):
        column = pf.read_row_group(rg, columns=[text_field]).column(0)
        for text in column.to_pylist():
            if not isinstance(text, str):
                raise ValueError(
                    f"{path}: row group {rg}: field {text_field!r} holds {type(text).__name__}, expected a string"
                )
            yield text


# ----------------------------------------------------------------------------- hub


def _iter_hf(spec: dict) -> Iterator[str]:
    path = spec.get("path")
    if not isinstance(path, str) or not path:
        raise ValueError(f"source spec (kind='hf'): 'path' must be a dataset id, got {path!r}")
    return _checked(f"hf dataset {path!r}", _gen_hf(spec))


def _gen_hf(spec: dict) -> Iterator[str]:
    try:
        import datasets
    except ImportError:
        raise ValueError("source spec (kind='hf') needs the 'datasets' package: pip install 'stem-repro[hub]'") from None
    text_field = spec.get("text_field", "text")
    kwargs = {"split": spec.get("split", "train"), "streaming": True}
    for key in ("data_files", "revision"):
        if spec.get(key) is not None:
            kwargs[key] = spec[key]
    ds = datasets.load_dataset(spec["path"], spec.get("name"), **kwargs)
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
