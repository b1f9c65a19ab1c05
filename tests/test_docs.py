"""The README stays a front door, and every relative link in README.md, docs/*.md and the benchmarks' index
(benchmarks/README.md) leads somewhere. No network.

Run: pytest tests/test_docs.py
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target) and ![alt](image)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)


def links(text: str) -> list[str]:
    """Targets of the Markdown links and images in text, outside code blocks and inline code."""
    text = FENCE.sub("", text)
    text = re.sub(r"`[^`\n]*`", "", text)
    return LINK.findall(text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    heading = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def relative_links() -> list[tuple[Path, str]]:
    return [(page, target) for page in PAGES for target in links(page.read_text())
            if not re.match(r"[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not checked


def test_the_readme_is_under_200_lines():
    assert len((ROOT / "README.md").read_text().splitlines()) < 200


def test_the_pages_have_links_to_check():
    assert len(PAGES) > 5 and len(relative_links()) > 20  # the link pattern still finds the links


@pytest.mark.parametrize("page, target", relative_links(), ids=lambda x: str(x.name) if isinstance(x, Path) else x)
def test_every_relative_link_points_at_a_file(page, target):
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    assert file.exists(), f"{page.relative_to(ROOT)}: {target} leads to no file"
    if anchor and file.suffix == ".md":
        assert anchor in anchors(file), f"{page.relative_to(ROOT)}: {target}: no heading #{anchor} in {file.name}"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in links((ROOT / "README.md").read_text())}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


def test_no_file_holds_a_merge_conflicts_markers():
    """A merge left `<<<<<<< HEAD` ... `>>>>>>> branch` in docs/architecture.md once, unseen by the link check."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    marker = re.compile(r"^(<{7} |>{7} )", re.MULTILINE)
    found = [name for name in tracked if name.endswith((".md", ".py", ".yaml", ".toml", ".txt", ".sh"))
             and marker.search((ROOT / name).read_text(encoding="utf-8", errors="replace"))]
    assert found == []
