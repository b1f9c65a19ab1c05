"""The HTML pages a person reads (issue 30): compare's page and the sweep report's, parsed with the standard
library's html.parser and checked against the runs' own numbers: the verdict line first with the exit code the
command returned, the compact table's columns and values, the documents that changed, the text rendered, no
network. The runs are made through lm-eval with the deterministic fake engine, no vLLM (tests/test_compare.py's
fake_run): the broken candidate answers " 13" to every arithmetic question, so its flips are known.
Run: pytest tests/test_compare_page.py
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from evalkit import page
from evalkit.compare import cli
from evalkit.compare.pages import html_page, plots
from evalkit.compare.statistics import paired, proportions, verdict
from evalkit.compare import runs as on_disk
from evalkit.sweep.points import write_point
from evalkit.sweep.report import write_report
from tests.fake_engine import FakeEngine
from tests.test_compare import fake_run
from tests.test_sweep_report import record

VOID = {"br", "img", "meta", "hr", "input", "link", "source", "wbr"}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list = field(default_factory=list)  # Node or str

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def words(self) -> str:
        return " ".join(self.text().split())

    def all(self, tag: str) -> list[Node]:
        found = []
        for child in self.children:
            if isinstance(child, Node):
                found += ([child] if child.tag == tag else []) + child.all(tag)
        return found

    def by_id(self, ident: str) -> Node | None:
        return next((n for n in self.walk() if n.attrs.get("id") == ident), None)

    def walk(self):
        for child in self.children:
            if isinstance(child, Node):
                yield child
                yield from child.walk()


class Tree(HTMLParser):
    """The page as a tree of Nodes; fails on a closing tag that does not match the open one."""

    def __init__(self, text: str):
        super().__init__(convert_charrefs=True)
        self.root = Node("root", {})
        self.stack = [self.root]
        self.feed(text)
        self.close()
        assert self.stack == [self.root], f"unclosed: {[n.tag for n in self.stack[1:]]}"

    def handle_starttag(self, tag, attrs):
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        assert self.stack[-1].tag == tag, f"</{tag}> closes <{self.stack[-1].tag}>"
        self.stack.pop()

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def rows(table: Node) -> tuple[list[str], list[Node]]:
    """A table's header words and its body rows."""
    head = [th.words() for th in table.all("thead")[0].all("th")]
    return head, table.all("tbody")[0].all("tr")


def cells(row: Node) -> list[Node]:
    return [c for c in row.children if isinstance(c, Node) and c.tag == "td"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("page_runs")
    return {"ref": fake_run(tmp, "a", FakeEngine()), "same": fake_run(tmp, "b", FakeEngine()),
            "broken": fake_run(tmp, "c", FakeEngine(reply=" 13"))}


def page_of(run_dir, reference) -> Node:
    return Tree((run_dir / f"compare-vs-{reference.parent.name}-{reference.name}.html").read_text()).root


def test_the_page_leads_with_the_verdict_and_its_exit_code_then_the_compact_table(runs):
    code = cli.main([str(runs["ref"]), str(runs["broken"])])
    table, _ = paired.compare_runs(on_disk.load_run(runs["ref"]), on_disk.load_run(runs["broken"]))
    assert code == verdict.gate([table]) == 1
    root = page_of(runs["broken"], runs["ref"])
    body = root.all("body")[0]
    first = [n for n in body.children if isinstance(n, Node)][:3]
    assert [n.tag for n in first] == ["h1", "p", "p"] and first[1].attrs["id"] == "verdict"  # before any table
    worse, m = int((table.verdict == "worse").sum()), len(table)
    inconclusive = int((table.verdict == "inconclusive").sum())
    needed = proportions.documents_needed(0.02)
    assert first[1].words() == (f"candidate is worse than reference on {worse} of {m} rows; {inconclusive} "
                                f"inconclusive — too few documents ({needed} needed, 12 here) (exit {code})")
    assert "fail" in first[1].attrs["class"]

    scores = body.all("table")[0]
    head, body_rows = rows(scores)
    assert head == html_page.SCORES == ["task", "metric", "n", "reference", "candidate", "diff [interval]",
                                          "verdict", "changed documents"]
    assert len(body_rows) == m
    for row, (_, expected) in zip(body_rows, table.iterrows()):
        words = [c.words() for c in cells(row)]
        assert words[0].startswith(expected.task) and words[1] == expected.metric and words[2] == str(expected.n)
        assert float(words[3]) == pytest.approx(expected.reference, rel=1e-3)
        assert float(words[4]) == pytest.approx(expected.candidate, rel=1e-3)
        diff, low, high = map(float, re.fullmatch(r"(\S+) \[(\S+), (\S+)\]", words[5]).groups())
        assert (diff, low, high) == pytest.approx((expected["diff"], expected.ci_low, expected.ci_high), abs=6e-4)
        assert words[6] == expected.verdict and row.attrs["class"] == f"v-{expected.verdict}"
    # the statistical columns are folded under the table
    details = body.all("details")[0]
    assert details.all("summary")[0].words().startswith("Statistics per row")
    assert {"mcnemar_b", "mcnemar_c", "p_worse_holm", "p_equivalent_holm", "method"} <= set(rows(details.all(
        "table")[0])[0])


def test_the_flipped_documents_are_a_table_linked_from_their_row(runs):
    cli.main([str(runs["ref"]), str(runs["broken"])])
    ref, cand = on_disk.load_run(runs["ref"]), on_disk.load_run(runs["broken"])
    _, details = paired.compare_runs(ref, cand)
    (arith,) = [d for d in details if d.task == "evalkit_arith"]
    lost = arith.flips["exact_match"]["right_to_wrong"]
    root = page_of(runs["broken"], runs["ref"])
    score_row = rows(root.all("table")[0])[1][0]
    link = cells(score_row)[7].all("a")[0]
    assert link.words() == f"{len(lost)} lost, 0 gained"
    heading = root.by_id(link.attrs["href"].lstrip("#"))
    assert heading is not None and heading.tag == "h3" and heading.words().startswith("evalkit_arith (first-integer)")
    flips = root.by_id("changed")
    assert flips is not None
    tables = [t for t in root.all("table") if rows(t)[0][:6] == ["doc", "change", "prompt", "target", "reference",
                                                                  "candidate"]]
    (flip_table,) = tables  # one task changed: the log-likelihood task's answers are the same
    head, body_rows = rows(flip_table)
    assert [int(cells(r)[0].words()) for r in body_rows] == lost
    for row in body_rows:
        doc, change, prompt, target, reference, candidate = cells(row)
        sample = (ref.samples["evalkit_arith"][(int(doc.words()), "first-integer")],
                  cand.samples["evalkit_arith"][(int(doc.words()), "first-integer")])
        assert change.words() == "exact_match: right → wrong" and row.attrs["class"] == "v-worse"
        assert prompt.all("details") and prompt.all("pre")[0].text() == sample[0]["prompt"]  # folded, whole
        assert target.words() == sample[0]["target"]
        assert reference.all("b")[0].words() == sample[0]["filtered_output"] == target.words()
        assert candidate.all("b")[0].words() == sample[1]["filtered_output"] == "13"
        assert reference.all("pre")[0].text() == sample[0]["raw_output"]  # the output, its differing part marked
        assert candidate.all("mark")[0].attrs["class"] == "cand"


def test_the_text_is_rendered_and_the_page_needs_no_network(runs):
    cli.main([str(runs["ref"]), str(runs["broken"])])
    text = (runs["broken"] / f"compare-vs-{runs['ref'].parent.name}-{runs['ref'].name}.md").read_text()
    root = page_of(runs["broken"], runs["ref"])
    report = root.by_id("report")
    assert report is not None and "## Samples" in text  # the .md stays
    rendered = next(n for n in root.walk() if n.attrs.get("class") == "report")
    assert [h.words() for h in rendered.all("h2")] == ["Divergence (token level)", "Samples"]  # default: recorded
    assert rendered.all("table") and rendered.all("li")
    assert not any("## " in pre.text() for pre in root.all("pre"))
    for node in root.walk():
        for name in ("src", "href"):
            value = node.attrs.get(name, "")
            assert not value.startswith(("http:", "https:", "//")), value
    assert all(img.attrs["src"].startswith("data:image/png;base64,") for img in root.all("img"))
    assert all(fig.all("figcaption")[0].words() for fig in root.all("figure"))  # every plot says what to read
    style = root.all("style")[0].text()
    assert "@media print" in style and "@media (max-width" in style
    page_words = root.words()
    assert "no log-probability drift above the noise floor" in page_words  # not a one-bar histogram


def test_every_candidates_page_says_the_commands_exit_code(runs):
    """Two candidates, one family: the unchanged one's page says the command exits 1 and why."""
    assert cli.main([str(runs["ref"]), str(runs["same"]), str(runs["broken"])]) == 1
    line = page_of(runs["same"], runs["ref"]).by_id("verdict").words()
    assert line.startswith("inconclusive on all 3 rows: too few documents (")
    assert line.endswith("(exit 1: another candidate is worse)")


def test_the_headline_words_for_equivalent_and_better_and_an_empty_table():
    table = pd.DataFrame({"task": ["a", "b", "c"], "filter": "none", "metric": "acc", "n": 400,
                          "verdict": ["equivalent", "lower", "equivalent"], "method": "tango", "tolerance": 0.02,
                          "relative": False})
    assert html_page.headline(table, exit_code=verdict.gate([table]), needed=149) == (
        "equivalent within ±0.02 on all 3 rows (exit 0)", "pass")
    better = table.assign(verdict=["better", "equivalent", "inconclusive"], n=[400, 400, 100])
    assert html_page.headline(better, exit_code=0, needed=149) == (
        "candidate is better than reference on 1 of 3 rows; 1 equivalent, 1 inconclusive — too few documents "
        "(149 needed, 100 here) (exit 0)", "unsure")
    mixed = better.assign(verdict=["inconclusive", "equivalent", "inconclusive"])  # one of them not for its size
    assert html_page.headline(mixed, exit_code=0, needed=149)[0] == (
        "inconclusive on 2 of 3 rows: 1 with too few documents (149 needed, 100 here), 1 see the notes; 1 equivalent "
        "(exit 0)")
    assert html_page.headline(table.iloc[:0], exit_code=0, needed=149) == ("nothing compared (exit 0)", "unsure")


def test_plots_that_would_say_nothing_are_sentences():
    assert plots.drift_plot([0.0, 5e-5, -2e-5], 1e-4) == page.Plot(
        None, "no log-probability drift above the noise floor (0.0001 nats) on 3 choices of the log-likelihood tasks")
    moved = plots.drift_plot([0.0, 0.5, -2.0, 5e-5], 1e-4)
    assert moved.png[:4] == b"\x89PNG" and moved.caption.startswith(
        "2 of 4 choices moved beyond the noise floor (0.0001 nats), the largest by 2: ")
    assert plots.length_plot([0, 0, 0]).png is None
    shifted = plots.length_plot([0, 2, -1, 0])
    assert shifted.png[:4] == b"\x89PNG" and shifted.caption.startswith("2 of 4 generations changed length")


def test_the_sweep_page_leads_with_its_verdict_and_links_each_point_to_its_comparison(runs, tmp_path):
    folder = tmp_path / "sweep"
    points = [record(0, "ok", runs["ref"], wall=3.0), record(1, "ok", runs["broken"], wall=3.0),
              record(2, "failed", error="max_model_len=100000 exceeds what fake supports (4096)", wall=0.4)]
    for point in points:
        write_point(folder / str(point.num), point)
    write_report(folder, runs_under=Path("/"))  # the runs lie in another temporary folder
    table = pd.read_csv(folder / "report.csv")
    root = Tree((folder / "report.html").read_text()).root
    worse = table[(table.point == 1) & table.verdict.isin(verdict.FAILING)]
    assert root.by_id("verdict").words() == (f"point 1 is worse than the reference (point 0) on {len(worse)} of "
                                             f"{int((table.point == 1).sum())} rows; point 2 failed")
    head, body_rows = rows(root.all("table")[0])
    assert head == ["point", "overrides", "task", "metric", "score ± stderr", "diff", "verdict", "tokens/s"]
    assert len(body_rows) == len(table)
    arith = next(r for r in body_rows if cells(r)[0].words() == "1" and cells(r)[2].words().startswith("evalkit_arith"))
    assert cells(arith)[6].all("a")[0].attrs["href"] == "compare-1-vs-0.html" and cells(arith)[6].words() == "worse"
    failed = next(r for r in body_rows if cells(r)[0].words() == "2")
    assert cells(failed)[6].words() == "failed" and "exceeds what fake supports" in cells(failed)[2].words()
    compared = Tree((folder / "compare-1-vs-0.html").read_text()).root
    line = compared.by_id("verdict").words()
    assert line.startswith("candidate is worse than reference on 1 of 3 rows") and "(exit" not in line
    assert compared.by_id("changed-evalkit_arith-first-integer") is not None


HOSTILE = 'x"\'/onmouseover=alert(document.domain)//><script>alert(1)</script>'
LEAK = " ![](//e.io/x)"  # the report shows 15 characters of an output from where it differs: room for an image


def inert(root: Node) -> None:
    """A page that runs and fetches nothing a run folder chose: a Content-Security-Policy that forbids every
    fetch but data: images, no handler attribute, only the print script the policy names by its digest, no image
    but data:, and no link out of the page but to the comparisons beside it."""
    import base64
    import hashlib

    policy = next(m.attrs["content"] for m in root.all("meta") if m.attrs.get("http-equiv") == "Content-Security-Policy")
    assert "default-src 'none'" in policy and "img-src data:;" in policy and "connect-src" not in policy
    digests = re.findall(r"'sha256-([^']+)'", policy)
    for script in root.all("script"):
        assert base64.b64encode(hashlib.sha256(script.text().encode()).digest()).decode() in digests
    for node in root.walk():
        assert not any(name.startswith("on") for name in node.attrs), (node.tag, node.attrs)
        assert node.tag not in ("iframe", "object", "embed", "link", "base", "form")
    assert all(img.attrs["src"].startswith("data:image/png;base64,") for img in root.all("img"))
    assert all(a.attrs["href"].startswith("#") or re.fullmatch(r"compare-\d+-vs-\d+\.html(#[\w-]+)?", a.attrs["href"])
               for a in root.all("a")), [a.attrs for a in root.all("a")]


def test_every_value_is_escaped_in_text_and_in_attributes():
    """A row class or a cell from a run folder (a point's status, a task name) stays a value: the attribute is
    quoted and escaped whatever quotes it holds, and a cell's text is text."""
    html = page.table(["task", "verdict"], [[page.cell(HOSTILE), page.cell("worse", css=HOSTILE)]],
                      row_classes=[page.verdict_class(HOSTILE)], numeric={"task"}, optional={"verdict"})
    root = Tree(html).root
    (row,) = root.all("tbody")[0].all("tr")
    assert row.attrs == {"class": page.verdict_class(HOSTILE)} and cells(row)[1].attrs["class"] == HOSTILE
    assert cells(row)[0].text() == HOSTILE and not root.all("script")
    assert not any(name.startswith("on") for node in root.walk() for name in node.attrs)
    assert page.attributes(class_=HOSTILE, data_opt=True, id=None) == f' class="{page.escape(HOSTILE)}" data-opt'


def test_a_model_output_loads_nothing_and_links_nowhere(runs, tmp_path):
    """A candidate whose outputs are Markdown images and links (rendered in the text report's samples): the
    compare page and the sweep page show them as text, and their policy forbids any fetch."""
    leaky = fake_run(tmp_path, "leaky", FakeEngine(reply=LEAK))
    assert cli.main([str(runs["ref"]), str(leaky)]) == 1
    text = (leaky / f"compare-vs-{runs['ref'].parent.name}-{runs['ref'].name}.md").read_text()
    assert "'![](//e.io/x)'" in text  # the output is in the report, as text
    inert(page_of(leaky, runs["ref"]))
    folder = tmp_path / "sweep"
    for point in (record(0, "ok", runs["ref"], wall=3.0), record(1, "ok", leaky, wall=3.0)):
        write_point(folder / str(point.num), point)
    write_report(folder, runs_under=Path("/"))  # the runs lie in another temporary folder
    for name in ("report.html", "compare-1-vs-0.html"):
        inert(Tree((folder / name).read_text()).root)
    for markdown in ("![x](https://e.io/p.png?leak=1)", "[sign in](https://e.io/)", "<https://e.io/>", "[a](//e.io)",
                     "[a](javascript:alert(1))", '<img src="https://e.io/">'):
        inert(Tree(page.document(title="t", headline="h", kind="pass", facts="",
                                 sections=[page.markdown_html(markdown)])).root)


def test_the_pages_of_ordinary_runs_are_inert_too(runs):
    cli.main([str(runs["ref"]), str(runs["broken"])])
    inert(page_of(runs["broken"], runs["ref"]))


def test_the_page_and_the_text_report_say_the_same_adjustment(runs):
    """The page's facts line and the text report's header say in one sentence (verdict.adjusted_over) how the
    verdicts are adjusted: Holm over every row, `worse` and `better` over the rows Tarone's screen keeps."""
    cli.main([str(runs["ref"]), str(runs["broken"])])
    table, _ = paired.compare_runs(on_disk.load_run(runs["ref"]), on_disk.load_run(runs["broken"]))
    sentence = verdict.adjusted_over(f"{len(table)} rows")
    assert "Tarone's screen" in sentence
    text = (runs["broken"] / f"compare-vs-{runs['ref'].parent.name}-{runs['ref'].name}.md").read_text()
    assert sentence in " ".join(text.split())
    body = page_of(runs["broken"], runs["ref"]).all("body")[0]
    facts = [n for n in body.children if isinstance(n, Node)][2]
    assert facts.tag == "p" and sentence.replace("`", "") in facts.words()
    assert [c.words() for c in facts.all("code")][2:4] == ["worse", "better"]  # after the two runs' names
