"""Values that come from outside evalkit's own process (a run folder from another machine, a URL the user gave) on
their way to a terminal, a record or a path: each helper makes one kind of use safe, whatever the value holds.

A run folder is data, never instructions (docs/security.md): a name it records is printed with its control
characters escaped, a file it names is opened only inside the folder, and a URL is recorded without credentials.
"""

from __future__ import annotations

import unicodedata
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


def printable(text: object, *, keep: str = "") -> str:
    """text with every control, format or unassigned character escaped (\\x1b, \\u202e), so that no value can
    move the cursor, retitle the terminal or reorder what it shows; characters in keep (e.g. newlines) stay."""
    return "".join(c if c in keep or not unicodedata.category(c).startswith("C") else _escape(c) for c in str(text))


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def without_credentials(url: str) -> str:
    """url with its user:password@ part removed, for records and messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


class OutsideFolder(ValueError):
    """A name recorded in a run folder that leads out of it (absolute, .., a link elsewhere)."""


def inside(folder: Path, name: object) -> Path:
    """folder/name when name is a plain relative path that stays in folder, links resolved; else OutsideFolder."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise OutsideFolder(f"{printable(name)!s} is not a file name")
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise OutsideFolder(f"{printable(name)} leads out of {folder}")
    path = folder / relative
    base = folder.resolve()
    if not path.resolve().is_relative_to(base):
        raise OutsideFolder(f"{printable(name)} leads out of {folder} (through a link)")
    return path
