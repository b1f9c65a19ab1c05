"""Values that cross a trust boundary (a run folder from another machine, a URL or environment the user gave) on
their way to a terminal, a record or a path: each helper makes one kind of use safe, whatever the value holds.

A run folder is data, never instructions (docs/security.md): a name it records is printed with its control
characters escaped, a file it names is opened only inside the folder and read only up to a bound
(:func:`file_limit`). What evalkit writes holds no credential: a URL is recorded without its user:password, a
secret variable by its name only; a file is replaced through a temporary that no planted link can redirect.
"""

from __future__ import annotations

import errno
import ipaddress
import json
import logging
import os
import re
import secrets
import stat
import unicodedata
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import urlsplit, urlunsplit

from evalkit.errors import ConfigError


def printable(text: object, *, keep: str = "") -> str:
    """text with every control, format or unassigned character escaped (\\x1b, \\u202e), so that no value can
    move the cursor, retitle the terminal or reorder what it shows; characters in keep (e.g. newlines) stay."""
    return "".join(c if c in keep or not unicodedata.category(c).startswith("C") else _escape(c) for c in str(text))


def _escape(char: str) -> str:
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def loopback(host: str) -> bool:
    """host names this machine only: localhost or a loopback address (a name is not resolved)."""
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def unencrypted_elsewhere(url: str) -> str:
    """The host url reaches over plain http:// when it is not this machine (what a key sent there crosses the
    network unencrypted to), else ""."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError:
        return ""
    return host if parts.scheme.lower() == "http" and host and not loopback(host) else ""


def without_credentials(url: str) -> str:
    """url with its user:password@ part removed (all before the netloc's last @), for records and messages."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))


# a URL's user:password@, also as Hydra writes an override (http\://user\:pass@host): everything up to the last @
# before the authority ends (a user name may hold an @, a password spaces), so free text may lose more, never less
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*\\?://)[^/?#\r\n\"'<>`]*@")
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


def literal_password(text: str) -> bool:
    """Whether a URL in text carries a user:password@ other than a user name and a ``${...}`` interpolation (as
    ``http://user:${oc.env:VAR}@host`` does, which keeps the password itself out of the text); Hydra's
    escaped ``\\:`` is read as ``:``."""
    for found in _USERINFO.finditer(text):
        userinfo = found.group(0)[len(found.group(1)):-1].replace("\\:", ":")
        if not re.fullmatch(r"[^:]*:\$\{[^}]*\}", userinfo):
            return True
    return False


class ScrubbedLog(logging.Filter):
    """A log handler's filter that takes the user:password of every URL out of each line (Hydra's launchers log
    each point's overrides)."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if scrubbed(text) != text:
            record.msg, record.args = scrubbed(text), None
        return True


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


FILE_LIMIT_VARIABLE = "EVALKIT_FILE_LIMIT_GIB"
FILE_LIMIT_GIB = 4.0  # the default: far above the files of a real run, far below a machine's memory


class TooLarge(ValueError):
    """A file from a run folder that would cost more than file_limit() to read (on disk, or decompressed)."""


def file_limit() -> int:
    """The most bytes evalkit reads from one file of a run folder (a results.json, a samples file, a divergence
    record once decompressed): EVALKIT_FILE_LIMIT_GIB, else 4 GiB."""
    text = os.environ.get(FILE_LIMIT_VARIABLE, "")
    try:
        gib = float(text) if text else FILE_LIMIT_GIB
    except ValueError:
        gib = FILE_LIMIT_GIB
    return int(max(gib, 0.0) * 2**30)


def too_large(path: Path, size: int, limit: int, how: str = "") -> TooLarge:
    """The one-line refusal of a file of size bytes (how: "decompressed", ...) above limit."""
    return TooLarge(f"{path} holds {size / 2**30:.3g} GiB{how}, above the {limit / 2**30:.3g} GiB evalkit reads "
                    f"from one file of a run folder; set {FILE_LIMIT_VARIABLE} higher where you trust the run")


class NotRegularFile(OSError):
    """A name in a run folder that is no regular file: a FIFO (reading it waits for a writer that never comes),
    a device, a socket, a folder."""


def open_regular(path: Path) -> BinaryIO:
    """path opened for reading where it is a regular file; else NotRegularFile, without waiting (a FIFO is opened
    non-blocking, so no writer is waited for)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotRegularFile(errno.EINVAL, "not a regular file (a FIFO, device, socket or folder)", str(path))
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bounded(path: Path, limit: int | None = None) -> bytes:
    """The bytes of path, TooLarge where it holds more than limit (file_limit()): never more is read;
    NotRegularFile where it is no regular file."""
    limit = file_limit() if limit is None else limit
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        data = f.read(limit + 1) if size <= limit else b""
    if size > limit or len(data) > limit:  # it may grow while read
        raise too_large(path, max(size, len(data)), limit)
    return data


FORMULA_START = ("=", "+", "-", "@", "\t", "\r")  # what a spreadsheet reads as the start of a formula


def spreadsheet_cell(value: object) -> object:
    """value for a CSV cell that a spreadsheet shows as text: a string that starts like a formula
    (``=HYPERLINK(...)``, ``+``, ``-``, ``@``) gets a leading ``'``; numbers and other strings stay as they are."""
    return "'" + value if isinstance(value, str) and value.startswith(FORMULA_START) else value


def json_data(text: str | bytes) -> Any:
    """json.loads of text from a run or sweep folder, whose crafted failures (nesting deeper than the parser
    recurses, an integer past Python's 4300 digits) are ValueErrors in one line, as a damaged file's are."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply to be a file evalkit wrote") from None
    except json.JSONDecodeError:
        raise
    except ValueError:
        raise ValueError("a number too long to be one evalkit wrote (over 4300 digits)") from None


def write_atomic(path: Path, data: str | bytes) -> Path:
    """Replace path with data through a temporary file beside it, created exclusively under a random name
    (O_CREAT | O_EXCL: a link planted at any name fails the create, never redirects the write), so readers see
    the old file or the whole new one. The file gets the mode the umask gives, as a plain write would."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.with_name(f".tmp-{path.name}-{secrets.token_hex(8)}")
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:
            continue
    else:
        raise FileExistsError(f"no free temporary name beside {path}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


class PlantedFile(ConfigError):
    """A file evalkit keeps open in an output folder (a lock, a request store, a server's log) that is a link, is
    not a regular file, or is another user's: it may have been planted there to redirect or feed a write."""


def open_own(path: Path, flags: int, mode: int = 0o644) -> int:
    """A descriptor of path opened with flags (os.O_CREAT, ...) where neither path nor its folder is a link and the
    file is a regular one of this user's (or of its folder's owner) with one name; else PlantedFile, before
    anything is written."""
    path = Path(path)
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise PlantedFile(_planted(path.parent, "is a link")) from None
    try:
        # the folder's owner may own it too: on NFS with root_squash a root user's files belong to nobody
        owners = {os.geteuid(), os.fstat(folder).st_uid}
        fd = os.open(path.name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=folder)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENXIO):  # ENXIO: a FIFO nobody reads, opened for writing
            raise
        raise PlantedFile(_planted(path, "is a link" if error.errno == errno.ELOOP else "is not a regular file"))
    finally:
        os.close(folder)
    found = os.fstat(fd)
    what = ("is not a regular file" if not stat.S_ISREG(found.st_mode) else "belongs to another user"
            if found.st_uid not in owners else "has another name (a hard link)" if found.st_nlink > 1 else "")
    if what:
        os.close(fd)
        raise PlantedFile(_planted(path, what))
    os.set_blocking(fd, True)
    return fd


def _planted(path: Path, what: str) -> str:
    return (f"{printable(path)} {what}: evalkit writes nothing through it (another user may have planted it); "
            "remove it, or pass output_dir= a folder only you can write to")


def fresh_folder(parent: Path, prefix: str) -> Path:
    """A new empty folder in parent named prefix and a random suffix (mkdir is exclusive: a planted link or folder
    at a predictable name can neither redirect nor block it), with the mode the umask gives."""
    for _ in range(100):
        folder = Path(parent) / f"{prefix}{secrets.token_hex(8)}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {parent}")
