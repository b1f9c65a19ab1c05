"""The docs speak to users, in the present: no issue numbers, no narration of how the work was done, no paths
of our own machines in what a user is told to run. A short word list over README.md and docs/*.md. No network.

Run: pytest tests/test_docs_words.py
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
WORDS = re.compile(r"\bissues? #?\d+|\buntil issue\b|\b(before|after) this change\b|\bengineers?\b|/tmp/|"
                   r"\bSTYLE \d+\b|\bwe (fixed|changed)\b|\bsession that wrote\b|\btimed by hand\b|"
                   r"\bcommits? [0-9a-f]{7}\b", re.IGNORECASE)


def test_the_word_list_finds_what_it_should():
    found = [bool(WORDS.search(text)) for text in ("until issue 28 it exited 0", "measured before this change",
                                                  "flock /tmp/x.lock", "(STYLE 14)", "the engine's seed",
                                                  "timed by hand", "(2026-12-01, commit 9e9b2e4)")]
    assert found == [True, True, True, True, False, True, True]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_a_page_speaks_to_users(page):
    hits = [f"{page.name}:{n}: {m.group(0)}" for n, line in enumerate(page.read_text().splitlines(), 1)
            for m in [WORDS.search(line)] if m]
    assert not hits, hits
