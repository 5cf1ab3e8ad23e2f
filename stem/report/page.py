"""A report page as data: a list of blocks, rendered as Markdown (README.md, diff.md) or as one
self-contained HTML file (report.html: tables as HTML, figures embedded as base64 PNG).

Both renderings are made from the same blocks, which are made from the report's data (tables, diff
results); nothing is parsed back from a rendered file. Inline text may hold ``**bold**``, ```code```
``*italic*`` and ``[text](link)``; a paragraph wrapped in ``_..._`` is italic.
"""
from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd


@dataclass(frozen=True)
class Heading:
    level: int
    text: str


@dataclass(frozen=True)
class Para:
    text: str


@dataclass(frozen=True)
class Quote:
    text: str


@dataclass(frozen=True)
class Items:
    items: tuple


@dataclass(frozen=True)
class Table:
    """A table as printed (every cell a string); ``empty`` is said instead of an empty table."""
    frame: pd.DataFrame
    empty: str = "_(no rows: this experiment has no stage for this table)_"


@dataclass(frozen=True)
class Image:
    alt: str
    path: str   # relative to the page


# ---- Markdown ------------------------------------------------------------------------------------
def md_table(w: pd.DataFrame, empty: str = Table.empty) -> str:
    if w.empty:
        return empty + "\n"
    esc = lambda x: str(x).replace("|", r"\|")  # noqa: E731  (a '|' in a cell, e.g. mean |cos|, ends the cell)
    lines = ["| " + " | ".join(map(esc, w.columns)) + " |", "|" + "|".join(["---"] * len(w.columns)) + "|"]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in w.itertuples(index=False)]
    return "\n".join(lines) + "\n"


def markdown(blocks) -> str:
    """Each block, then a blank line (the text ends with one newline)."""
    out = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + b.text)
        elif isinstance(b, Para):
            out.append(b.text)
        elif isinstance(b, Quote):
            out.append("> " + b.text)
        elif isinstance(b, Items):
            out += [f"- {i}" for i in b.items]
        elif isinstance(b, Table):
            out.append(md_table(b.frame, b.empty).rstrip("\n"))
        elif isinstance(b, Image):
            out.append(f"![{b.alt}]({b.path})")
        else:
            raise TypeError(f"not a page block: {b!r}")
        out.append("")
    return "\n".join(out)


# ---- HTML ----------------------------------------------------------------------------------------
_INLINE = [(re.compile(r"\*\*(.+?)\*\*"), r"<strong>\1</strong>"), (re.compile(r"\*([^*\s][^*]*?)\*"), r"<em>\1</em>"),
           (re.compile(r"`(.+?)`"), r"<code>\1</code>"),
           (re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)"), r'<a href="\2">\1</a>')]


def inline(text: str) -> str:
    s = html.escape(text, quote=False)
    for pattern, repl in _INLINE:
        s = pattern.sub(repl, s)
    if len(s) > 2 and s[0] == s[-1] == "_":
        s = f"<em>{s[1:-1]}</em>"
    return s


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def html_table(w: pd.DataFrame, empty: str = Table.empty) -> str:
    if w.empty:
        return f"<p>{inline(empty)}</p>"
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in w.columns)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in r) + "</tr>"
                   for r in w.itertuples(index=False))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"


CSS = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;line-height:1.45}"
       "table{border-collapse:collapse;margin:.5em 0 1em;font-size:.85em}th,td{border:1px solid #ccc;"
       "padding:.2em .5em;text-align:right}th{background:#f3f3f3}td:nth-child(-n+2){text-align:left}"
       "blockquote{border-left:4px solid #e0a000;margin:1em 0;padding:.3em 1em;background:#fff8e6}"
       "img{max-width:100%;border:1px solid #eee}code{background:#f3f3f3;padding:0 .2em}")


def to_html(blocks, title: str, base_dir) -> str:
    """One self-contained HTML document; images are read from ``base_dir`` and embedded as base64."""
    body = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f'<h{b.level} id="{_slug(b.text)}">{inline(b.text)}</h{b.level}>')
        elif isinstance(b, Para):
            body.append(f"<p>{inline(b.text)}</p>")
        elif isinstance(b, Quote):
            body.append(f"<blockquote>{inline(b.text)}</blockquote>")
        elif isinstance(b, Items):
            body.append("<ul>" + "".join(f"<li>{inline(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, Table):
            body.append(html_table(b.frame, b.empty))
        elif isinstance(b, Image):
            data = base64.b64encode((Path(base_dir) / b.path).read_bytes()).decode("ascii")
            body.append(f'<img alt="{html.escape(b.alt)}" src="data:image/png;base64,{data}">')
        else:
            raise TypeError(f"not a page block: {b!r}")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{CSS}</style></head><body>\n"
            + "\n".join(body) + "\n</body></html>\n")
