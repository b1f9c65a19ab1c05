"""The one HTML page template of evalkit's reports: compare's page and the sweep
report's (evalkit/sweep/report_page.py), below both so each imports it directly. Pure functions from
already-computed content to HTML text, and the two helpers every report's figures use (pyplot with Agg, png).

A page leads with its verdict line, coloured by what it says; then its tables (cells coloured by verdict),
its plots, each with a caption saying what to read in it (a sentence where a plot would say nothing), and
the text report rendered from its Markdown by markdown-it-py (CommonMark with tables; raw HTML in the text is
escaped, images and links out of the page are shown as text). It is self-contained: the style inline, the images
as data URIs, no script or font from the network, so it opens from a CI artifact or a mail; its
Content-Security-Policy forbids any fetch, whatever a run folder's values hold. Every value, in text or in an
attribute, goes through escape() or attributes(). It reads on a narrow screen (wide tables scroll inside
their own box) and prints (a print stylesheet; folded sections open before printing).
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
from dataclasses import dataclass
from typing import Iterable

from markdown_it import MarkdownIt

KINDS = ("fail", "unsure", "pass")  # a headline's colour: red, amber, green

STYLE = """
:root{color-scheme:light}
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#1d1d1f;max-width:1360px;
 margin:0 auto;padding:1rem 1.2rem}
h1{font-size:1.3rem;margin:.2rem 0 .6rem;color:#444;font-weight:600}
h2{font-size:1.15rem;margin:1.6rem 0 .5rem;border-bottom:1px solid #ddd;padding-bottom:.2rem}
h3{font-size:1rem;margin:1.2rem 0 .4rem}
.headline{font-size:1.3rem;font-weight:600;margin:.4rem 0 .3rem;padding:.6rem .9rem;border-left:7px solid;
 border-radius:4px}
.headline.fail{background:#fde4e2;border-color:#c62828}
.headline.unsure{background:#fff3d6;border-color:#b7791f}
.headline.pass{background:#e5f3e8;border-color:#2e7d32}
.facts{color:#555;margin:.2rem 0 1rem;font-size:.92rem}
.facts code{font-size:.88rem}
table{border-collapse:collapse;margin:.3rem 0 .8rem}
table.fit{width:100%}
th,td{border:1px solid #d7d7d7;padding:4px 8px;text-align:left;vertical-align:top;overflow-wrap:break-word}
th{background:#f3f3f3;font-weight:600}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums;white-space:nowrap}
tr.v-worse td,tr.v-changed td{background:#fde4e2}
tr.v-better td{background:#e3f0fb}
tr.v-equivalent td,tr.v-lower td,tr.v-higher td{background:#edf7ee}
tr.v-inconclusive td{background:#fff8e6}
tr.v-failed td,tr.v-not-comparable td{background:#f1f1f1;color:#555}
td.verdict{font-weight:600;white-space:nowrap}
.scroll{overflow-x:auto;max-width:100%}
figure{margin:.6rem 0 1.2rem}
figure img{max-width:100%;height:auto;border:1px solid #eee}
figcaption,.caption{color:#444;font-size:.92rem;max-width:60rem}
p.none{color:#444;font-style:italic}
pre,code{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:.86rem}
pre{white-space:pre-wrap;overflow-wrap:anywhere;background:#f6f6f6;padding:.5rem;margin:.2rem 0}
td pre{background:none;padding:0;margin:0}
mark.ref{background:#c9e7cb}
mark.cand{background:#f7c6c4}
mark.cut{background:#ffe08a;outline:1px solid #b7791f}
details{margin:.3rem 0}
summary{cursor:pointer;color:#333}
.report table{display:block;overflow-x:auto}
.report h1{display:none}
a{color:#0b57d0}
@media (max-width:760px){
 body{font-size:14px;padding:.5rem}
 .headline{font-size:1.1rem}
 th,td{padding:3px 4px}
 table.fit{display:block;overflow-x:auto}
 [data-opt]{display:none}
 table.fit{font-size:13px}
 table.fit td,table.fit th{overflow-wrap:anywhere;white-space:normal}
 table.fit td.verdict,table.fit td.num{overflow-wrap:normal}
}
@media print{
 body{max-width:none;font-size:11pt;padding:0}
 .scroll,.report table,table.fit{overflow:visible;display:table}
 tr,figure{break-inside:avoid}
 a{color:inherit;text-decoration:none}
 tr td,.headline{-webkit-print-color-adjust:exact;print-color-adjust:exact}
 details::details-content{content-visibility:visible;display:contents}
}
"""

# Opens every folded section before printing (browsers print a closed <details> closed). Inline, no network.
PRINT_SCRIPT = ("window.addEventListener('beforeprint',()=>document.querySelectorAll('details')"
                ".forEach(d=>d.open=true));")

# The text report holds values from run folders (model outputs, task names): no image, and links only to a part
# of the page itself, so that rendering it fetches nothing and sends no reader elsewhere
_MARKDOWN = MarkdownIt("commonmark", {"html": False}).enable("table").disable("image")
_MARKDOWN.validateLink = lambda url: url.startswith("#")
# What the page may load: its own inline style, the print script above (by its digest), data: images; nothing
# from the network, whatever a value in it says (a browser that reads it refuses every other fetch)
POLICY = ("default-src 'none'; img-src data:; style-src 'unsafe-inline'; "
          f"script-src 'sha256-{base64.b64encode(hashlib.sha256(PRINT_SCRIPT.encode()).digest()).decode()}'; "
          "base-uri 'none'; form-action 'none'")


@dataclass(frozen=True)
class Plot:
    """A plot and what to read in it; png None: the plot would carry no information, and the caption says so."""

    png: bytes | None
    caption: str


def escape(value: object) -> str:
    """value as HTML text or an attribute's value: &, <, >, " and ' escaped (quote=True)."""
    return html.escape("" if value is None else str(value), quote=True)


def attributes(**values: object) -> str:
    """HTML attributes, each value escaped and quoted: ' class="v-worse"'. True: the bare name; None, False or
    "": left out. The one way page attributes are written, so a value from a run folder stays a value."""
    return "".join(f" {name.rstrip('_').replace('_', '-')}" if value is True else
                   f' {name.rstrip("_").replace("_", "-")}="{escape(value)}"'
                   for name, value in values.items() if value not in (None, False, ""))


def markdown_html(text: str) -> str:
    """A report's Markdown as HTML (markdown-it-py, CommonMark and tables; raw HTML escaped, not passed)."""
    return _MARKDOWN.render(text)


def cell(content: str, *, css: str = "", raw: bool = False) -> str:
    """A table cell; content escaped unless raw (already HTML)."""
    return f"<td{attributes(class_=css)}>{content if raw else escape(content)}</td>"


def table(columns: Iterable[str], rows: Iterable[Iterable[str]], *, row_classes: Iterable[str] | None = None,
          numeric: Iterable[str] = (), optional: Iterable[str] = (), fit: bool = False, caption: str = "") -> str:
    """An HTML table: columns (header text), rows of ready cells (cell()), each row's class (its verdict).
    optional: columns a narrow screen leaves out, so that the verdict stays in view."""
    columns, numeric, optional = list(columns), set(numeric), set(optional)
    narrow = [attributes(data_opt=c in optional) for c in columns]
    head = "".join(f"<th{attributes(class_='num' if c in numeric else None)}{o}>{escape(c)}</th>"
                   for c, o in zip(columns, narrow))
    rows = [[c.replace("<td", f"<td{o}", 1) for c, o in zip(r, narrow)] for r in rows]
    classes = list(row_classes) if row_classes is not None else [""] * len(rows)
    body = "\n".join(f"<tr{attributes(class_=css)}>{''.join(r)}</tr>" for r, css in zip(rows, classes))
    top = f"<caption>{escape(caption)}</caption>" if caption else ""
    return f'<table{attributes(class_="fit" if fit else None)}>{top}<thead><tr>{head}</tr></thead>\n<tbody>\n{body}\n</tbody></table>'


def verdict_class(verdict: object) -> str:
    """The CSS class of a row by its verdict: v-worse, v-equivalent, v-not-comparable, ..."""
    return "v-" + "-".join(str(verdict or "none").split(":")[0].split())


def figure(title: str, plot: Plot) -> str:
    """A titled plot with its caption, the image inline; or the caption alone, as a sentence."""
    if plot.png is None:
        return f"<h3>{escape(title)}</h3>\n<p class=none>{escape(plot.caption)}</p>"
    data = base64.b64encode(plot.png).decode()
    return (f'<h3>{escape(title)}</h3>\n<figure><img alt="{escape(title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{escape(plot.caption)}</figcaption></figure>")


def folded(summary: str, content: str, *, open_: bool = False) -> str:
    """A folded section (<details>): summary text, content HTML."""
    return f"<details{' open' if open_ else ''}><summary>{escape(summary)}</summary>\n{content}\n</details>"


def document(*, title: str, headline: str, kind: str, facts: str, sections: Iterable[str]) -> str:
    """The whole page: the headline (kind: fail, unsure or pass), a line of facts (HTML), then the sections."""
    if kind not in KINDS:
        raise ValueError(f"headline kind {kind!r}: one of {', '.join(KINDS)}")
    body = "\n".join(sections)
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="{escape(POLICY)}">
<title>{escape(title)}</title>
<style>{STYLE}</style>
<script>{PRINT_SCRIPT}</script>
</head><body>
<h1>{escape(title)}</h1>
<p class="headline {kind}" id="verdict">{escape(headline)}</p>
<p class=facts>{facts}</p>
{body}
</body></html>
"""


def png(fig) -> bytes:
    """A matplotlib figure as PNG bytes, for a Plot."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def pyplot():
    """matplotlib's pyplot with the Agg backend (no display), imported only when a report draws; text is drawn as
    it is written (a name a run chose, "$x^$", is no mathtext for matplotlib to parse and fail on)."""
    import matplotlib

    matplotlib.use("Agg")
    matplotlib.rcParams["text.parse_math"] = False
    import matplotlib.pyplot as plt

    return plt
