"""Content hashes of objects and files, shared by what keys a request store (evalkit/store/fingerprint.py),
what names a run's sources (evalkit/run/sources.py), the embedded model's check and a served model's weights.

A model folder signs as its files' hashes; a large file is hashed once and kept by path, size, mtime and inode
(``digest_cache``), so a 16 GB checkpoint is not read again on every start.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from evalkit.config import cache_dir

SMALL_FILE = 16 << 20  # model files up to this size are hashed on every start; larger ones once (large_file_sha256)


def sha256(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def hub_revision(model_id: str, revision: str | None = None, cache: str | Path | None = None) -> str | None:
    """The commit a hub id resolved to, from the local hub cache that vLLM downloads into (None if absent)."""
    if revision and len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision
    if cache is None:
        from huggingface_hub.constants import HF_HUB_CACHE as cache
    ref = Path(cache) / f"models--{model_id.replace('/', '--')}" / "refs" / (revision or "main")
    return ref.read_text().strip() if ref.is_file() else None


def digest_cache() -> Path:
    return cache_dir() / "file-digests.json"


def large_file_sha256(path: Path, cache: Path | None = None) -> str:
    """The content hash of a large file, computed once: kept by (path, size, mtime, inode), so a same-shape
    checkpoint copied with ``cp -p`` (same size and mtime, another inode) is hashed anew."""
    cache = cache or digest_cache()
    stat = path.stat()
    key = json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino])
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key not in known:
        known[key] = file_sha256(path)
        cache.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache.parent, prefix=f".{cache.name}.")  # exclusive: no link redirects it
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(known))
        os.replace(tmp, cache)  # another process's entries may be lost; they are recomputed, never wrong
    return known[key]


def model_files(model_dir: str, revision: str | None = None) -> dict[str, Any]:
    """A content signature of a model folder; a hub id signs as itself and the commit it resolved to."""
    root = Path(model_dir)
    if not root.is_dir():
        return {"id": model_dir, "revision": hub_revision(model_dir, revision)}
    files = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        small = path.stat().st_size <= SMALL_FILE
        files[str(path.relative_to(root))] = file_sha256(path) if small else large_file_sha256(path)
    return files
