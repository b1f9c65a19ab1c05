"""Values that cross a trust boundary (a run folder from another machine, a URL or environment the user gave) on
their way to a terminal, a record or a path: each helper makes one kind of use safe, whatever the value holds.

A run folder is data, never instructions (docs/security.md): a name it records is printed with its control
characters escaped and a file it names is opened only inside the folder. What evalkit writes holds no
credential: a URL is recorded without its user:password, a secret variable by its name only.
"""

from __future__ import annotations

import re
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


# a URL's user:password@, also as Hydra writes an override (http\://user\:pass@host)
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*\\?://)[^/?#\s@]+@")
SECRET_NAME = re.compile(r"(?i)KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH")  # a variable whose value is a secret
NOT_RECORDED = "(secret: not recorded)"


def scrubbed(value: object) -> object:
    """value (a record: dicts, lists, strings) with the user:password@ of every URL in it removed."""
    if isinstance(value, str):
        return _USERINFO.sub(r"\1", value)
    if isinstance(value, dict):
        return {k: scrubbed(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrubbed(v) for v in value]
    return value


def environment(environ: dict[str, str], prefix: str) -> dict[str, str]:
    """The variables starting with prefix, for a record: a secret's (by its name: *KEY*, *TOKEN*, ...) named, its
    value not copied; the others' URLs scrubbed."""
    return {k: NOT_RECORDED if SECRET_NAME.search(k) else str(scrubbed(v))
            for k, v in sorted(environ.items()) if k.startswith(prefix)}


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
