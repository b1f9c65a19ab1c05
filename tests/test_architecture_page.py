"""docs/architecture.md held to the code: its stages diagram and import contracts are pyproject.toml's
[tool.importlinter] contracts layer for layer, its Engine table names every member of evalkit.contracts.Engine
with its arguments, its records every frozen record of evalkit/contracts.py with its fields, its layout every
package and module of evalkit/ (one line each), and every module it names exists. A module, a member, a field or
a layer missing from the page, or named there but gone from the code, fails here. No engine starts.

Run: pytest tests/test_architecture_page.py
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import tomllib
from pathlib import Path

from evalkit import contracts

ROOT = Path(__file__).resolve().parent.parent
PAGE = (ROOT / "docs" / "architecture.md").read_text()
CONTRACTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
CHAIN = re.compile(r"`[^`]+`(?:\s*→\s*`[^`]+`)+")  # `top layer` → `next` → ... → `bottom`


def section(title: str) -> str:
    """The text under '## title', up to the next section of its level."""
    start = PAGE.index(f"\n## {title}\n")
    end = PAGE.find("\n## ", start + 1)
    return PAGE[start:end if end >= 0 else len(PAGE)]


def spans(text: str) -> list[str]:
    """The code spans of text (its fenced blocks left out), a span broken over lines read as one line."""
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]


def names(arguments: str) -> tuple[str, ...]:
    """'requests: [ScoreRequest], top_k=5' -> ('requests', 'top_k'): each argument's name, in order."""
    depth, parts, part = 0, [], ""
    for char in arguments:
        depth += (char in "[(") - (char in "])")
        if char == "," and depth == 0:
            parts, part = [*parts, part], ""
        else:
            part += char
    return tuple(n for p in [*parts, part] if (n := re.split(r"[:=]", p)[0].strip()) not in ("", "*"))


def layers(contract: dict) -> list[str]:
    return [" ".join(layer.split()) for layer in contract["layers"]]


def test_the_stages_diagram_is_the_stages_contract():
    diagram = section("The stages").split("```")[1]
    drawn = [re.split(r"\s{2,}", line)[0] for line in diagram.splitlines()
             if line.strip() and not line.startswith(" ")]
    assert drawn == layers(next(c for c in CONTRACTS if c["id"] == "stages"))


def test_the_import_contracts_are_listed_layer_for_layer():
    text = section("The import contracts")
    items = {m.group(1): m.group(2) for m in re.finditer(r"^- \*\*([\w-]+)\*\*(.*?)(?=^- |^\S|\Z)", text, re.M | re.S)}
    assert set(items) == {c["id"] for c in CONTRACTS}, "the contracts the page lists are pyproject.toml's"
    for contract in CONTRACTS:
        item = items[contract["id"]]
        if contract["type"] != "layers":
            continue
        chain = CHAIN.search(item)
        assert chain, f"{contract['id']}: no chain of layers `a` → `b` on the page"
        assert spans(chain.group(0)) == layers(contract), contract["id"]
        assert all(container in spans(item) for container in contract.get("containers", [])), contract["id"]


def engine_members() -> dict[str, tuple[str, ...] | None]:
    """Engine's members: an attribute -> None, a method -> its arguments' names but self."""
    members = {name: None for name in contracts.Engine.__annotations__}
    for name, value in vars(contracts.Engine).items():
        if inspect.isfunction(value) and not name.startswith("_"):
            members[name] = tuple(inspect.signature(value).parameters)[1:]
    return members


def test_the_engine_table_is_the_engine_protocol():
    shown: dict[str, tuple[str, ...] | None] = {}
    for row in re.findall(r"^\| `(.+?)` \|", section("The contracts (`evalkit/contracts.py`)"), re.M):
        for span in spans(f"`{row}`"):
            member = re.fullmatch(r"(\w+)(?:\((.*)\))?(?:\s*→.*)?", span)
            assert member, f"the Engine table's {span!r} is not a member"
            shown[member.group(1)] = None if member.group(2) is None else names(member.group(2))
    assert shown == engine_members()


def test_the_records_are_the_contracts_records_field_for_field():
    records = {name: tuple(f.name for f in dataclasses.fields(value)) for name, value in vars(contracts).items()
               if dataclasses.is_dataclass(value) and value.__module__ == contracts.__name__}
    text = section("The contracts (`evalkit/contracts.py`)").split("The records are")[1]
    shown = {m.group(1): names(m.group(2)) for s in spans(text) if (m := re.fullmatch(r"([A-Z]\w+)\((.*)\)", s))}
    assert shown == records


def laid_out() -> list[str]:
    """The paths the layout names, one a line: a nested list of `folder/` and `module.py` items."""
    folders: list[str] = []
    paths = []
    for indent, name in re.findall(r"^( *)- `([^`]+)`", section("Layout"), re.M):
        depth = len(indent) // 2
        path = "/".join([*folders[:depth], name.rstrip("/")])
        folders = [*folders[:depth], name.rstrip("/")]
        paths.append(path + ("/" if name.endswith("/") else ""))
    return paths


def test_the_layout_is_every_package_and_module_one_line_each():
    code = {f"{p.relative_to(ROOT).parent}/" if p.name == "__init__.py" else str(p.relative_to(ROOT))
            for p in (ROOT / "evalkit").rglob("*.py") if "__pycache__" not in p.parts}
    shown = laid_out()
    assert len(shown) == len(set(shown)), "a path the layout names twice"
    assert sorted(set(shown) - code) == [], "named on the page, gone from the code"
    assert sorted(code - set(shown)) == [], "in the code, missing from the page"


def test_every_module_the_page_names_exists():
    files = [str(p.relative_to(ROOT)) for folder in ("evalkit", "tests", "benchmarks")
             for p in (ROOT / folder).rglob("*.py")]
    named = {s for s in spans(PAGE) if re.fullmatch(r"[\w/]+\.py", s)}
    gone = sorted(n for n in named if not any(f == n or f.endswith("/" + n) for f in files))
    assert gone == [], "named on the page, no such module"
