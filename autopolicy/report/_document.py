"""A report as a list of blocks, rendered to Markdown and to one self-contained HTML page.

Both renderings come from the same blocks, so the two files always say the same thing.
"""

from __future__ import annotations

import base64
import dataclasses
import html
from typing import Iterable, Mapping, Union

import pandas as pd

from autopolicy.report._cells import format_cell, is_numeric_column
from autopolicy.report.tables import to_markdown as table_to_markdown

__all__ = ["Heading", "Paragraph", "Facts", "Bullets", "Alert", "Table", "Image", "Block", "to_markdown",
           "to_html"]


@dataclasses.dataclass
class Heading:
    text: str
    level: int = 2


@dataclasses.dataclass
class Paragraph:
    text: str


@dataclasses.dataclass
class Facts:
    """A bulleted list of ``label: value`` pairs."""

    items: list[tuple[str, str]]


@dataclasses.dataclass
class Bullets:
    """A bulleted list of lines, each shown verbatim (code-like text in a monospace font)."""

    items: list[str]


@dataclasses.dataclass
class Alert:
    """A warning the reader must not miss: a quoted, bold-labelled paragraph, boxed in HTML."""

    text: str


@dataclasses.dataclass
class Table:
    frame: pd.DataFrame


@dataclasses.dataclass
class Image:
    """A PNG figure, at ``path`` relative to the report."""

    caption: str
    path: str


Block = Union[Heading, Paragraph, Facts, Bullets, Alert, Table, Image]

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2rem auto; max-width: 1200px;
       padding: 0 1rem; color: #222; line-height: 1.45; }
h1 { border-bottom: 2px solid #ddd; padding-bottom: .3rem; }
h2 { border-bottom: 1px solid #eee; padding-bottom: .2rem; margin-top: 2rem; }
.scroll { overflow-x: auto; }
table { border-collapse: collapse; font-size: .85rem; margin: .5rem 0 1rem; }
th, td { border: 1px solid #ddd; padding: .25rem .5rem; vertical-align: top; }
th { background: #f3f4f6; text-align: left; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafafa; }
figure { margin: 1rem 0 2rem; }
figure img { max-width: 100%; height: auto; border: 1px solid #eee; }
.warning { border: 2px solid #c0392b; background: #fdecea; padding: .5rem .8rem; border-radius: 4px; }
ul.lines code { font-size: .85rem; }
""".strip()


def _markdown_block(block: Block) -> str:
    if isinstance(block, Heading):
        return "#" * block.level + " " + block.text
    if isinstance(block, Paragraph):
        return block.text
    if isinstance(block, Facts):
        return "\n".join(f"- **{label}:** {value}" for label, value in block.items)
    if isinstance(block, Bullets):
        return "\n".join("- `" + line.replace("`", "'") + "`" for line in block.items)
    if isinstance(block, Alert):
        return f"> **⚠ Warning:** {block.text}"
    if isinstance(block, Table):
        return table_to_markdown(block.frame).rstrip("\n")
    if isinstance(block, Image):
        return f"![{block.caption}]({block.path})"
    raise TypeError(f"Unknown report block: {block!r}")


def to_markdown(blocks: Iterable[Block]) -> str:
    """The blocks as Markdown, separated by blank lines."""
    return "\n\n".join(_markdown_block(b) for b in blocks) + "\n"


def _html_table(frame: pd.DataFrame) -> str:
    numeric = [is_numeric_column(frame.iloc[:, i]) for i in range(frame.shape[1])]
    cls = [' class="num"' if n else "" for n in numeric]
    head = "".join(f"<th{c}>{html.escape(str(name))}</th>" for c, name in zip(cls, frame.columns))
    rows = "".join(
        "<tr>" + "".join(f"<td{c}>{html.escape(format_cell(v))}</td>" for c, v in zip(cls, row)) + "</tr>"
        for row in frame.itertuples(index=False, name=None))
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table></div>'


def _html_block(block: Block, images: Mapping[str, bytes]) -> str:
    if isinstance(block, Heading):
        return f"<h{block.level}>{html.escape(block.text)}</h{block.level}>"
    if isinstance(block, Paragraph):
        return f"<p>{html.escape(block.text)}</p>"
    if isinstance(block, Facts):
        items = "".join(f"<li><strong>{html.escape(k)}:</strong> {html.escape(v)}</li>" for k, v in block.items)
        return f"<ul>{items}</ul>"
    if isinstance(block, Bullets):
        lines = "".join(f"<li><code>{html.escape(line)}</code></li>" for line in block.items)
        return f'<ul class="lines">{lines}</ul>'
    if isinstance(block, Alert):
        return f'<div class="warning" role="alert"><strong>⚠ Warning:</strong> {html.escape(block.text)}</div>'
    if isinstance(block, Table):
        return _html_table(block.frame)
    if isinstance(block, Image):
        data = base64.b64encode(images[block.path]).decode("ascii")
        caption = html.escape(block.caption)
        return f'<figure><img src="data:image/png;base64,{data}" alt="{caption}"></figure>'
    raise TypeError(f"Unknown report block: {block!r}")


def to_html(blocks: Iterable[Block], title: str, images: Mapping[str, bytes]) -> str:
    """One HTML page with inline CSS and every image embedded as a data URI (no external
    resource), ``images`` mapping each :class:`Image` path to its PNG bytes."""
    body = "\n".join(_html_block(b, images) for b in blocks)
    head = (f'<meta charset="utf-8">\n<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>\n{_CSS}\n</style>")
    return f'<!DOCTYPE html>\n<html lang="en">\n<head>\n{head}\n</head>\n<body>\n{body}\n</body>\n</html>\n'
