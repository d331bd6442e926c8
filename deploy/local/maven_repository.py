"""deploy/local/maven.py's remote repository (Maven Central's layout), with a verified local copy of
every file fetched: each POM and jar is checked against the ``.sha1`` published beside it."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from maven_model import ResolveError

TIMEOUT = 60.0


class Repository:
    """Remote repository with a verified local copy of every file fetched."""

    def __init__(self, cache: Path, url: str) -> None:
        self.root = cache
        self.url = url.rstrip("/")

    def fetch(self, relative: str) -> Path:
        local = self.root / relative
        recorded = local.with_name(local.name + ".sha1")
        if local.exists() and recorded.exists() and _sha1(local) == recorded.read_text().strip():
            return local
        expected = self._get(relative + ".sha1").decode("ascii", "replace").split()
        if not expected or not re.fullmatch(r"[0-9a-f]{40}", expected[0]):
            raise ResolveError(f"{relative}.sha1 does not hold a SHA-1 checksum")
        body = self._get(relative)
        actual = hashlib.sha1(body).hexdigest()
        if actual != expected[0]:
            raise ResolveError(f"{relative}: SHA-1 {actual} does not match the published {expected[0]}")
        local.parent.mkdir(parents=True, exist_ok=True)
        _write_atomically(local, body)
        _write_atomically(local.with_name(local.name + ".sha1"), actual.encode())
        return local

    def _get(self, relative: str) -> bytes:
        url = f"{self.url}/{relative}"
        try:
            with urllib.request.urlopen(url, timeout=TIMEOUT) as answer:
                body: bytes = answer.read()
                return body
        except urllib.error.HTTPError as exc:
            raise ResolveError(f"{url}: HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ResolveError(f"{url}: {getattr(exc, 'reason', exc)}") from None


def _sha1(path: Path) -> str:
    digest = hashlib.sha1()
    with path.open("rb") as source:
        for chunk in iter(lambda: source.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_atomically(path: Path, body: bytes) -> None:
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(handle, "wb") as out:
        out.write(body)
    os.replace(temporary, path)
