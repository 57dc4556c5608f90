"""Optional integrity against tampering: a SHA-256 of every file and an HMAC-SHA256 of the manifest.

The CRC-32s and the manifest's seal find accidents (a flipped bit, a truncated copy); anyone can recompute
them. A checkpoint saved with ``key=`` also lists each file's SHA-256 and carries ``hmac_sha256``, the
HMAC-SHA256 under that key of the manifest's canonical JSON (``format.canonical``; everything but the seal and
the digest itself, so every file through its SHA-256). A load with ``key=`` checks the digest before it reads
anything else, then every file's SHA-256: without the key no one can change a byte unnoticed. Without a key,
the SHA-256 list still lets a user sign ``manifest.json`` out of band (e.g. ``gpg --detach-sign``).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from optstack.checkpoint.format import canonical

__all__ = ["DIGEST", "check_key", "file_sha256", "sign", "check_signature"]

DIGEST = "hmac_sha256"  # the manifest field holding the signature
_UNSIGNED = (DIGEST, "seal")


def check_key(key: Any) -> bytes | None:
    """``key`` as bytes (a str as UTF-8), None for none; ``ValueError`` for an empty key or another type."""
    if key is None:
        return None
    if isinstance(key, str):
        key = key.encode()
    if not isinstance(key, bytes | bytearray) or not key:
        raise ValueError(f"key must be non-empty bytes or str (the secret the checkpoint is signed with), got "
                         f"{type(key).__name__}{' (empty)' if isinstance(key, bytes | bytearray) else ''}")
    return bytes(key)


def file_sha256(path: Path) -> str:
    """A file's SHA-256 as 64 hex digits, read in chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 23):
            h.update(chunk)
    return h.hexdigest()


def sign(manifest: Mapping[str, Any], key: bytes) -> str:
    """The HMAC-SHA256 under ``key`` of the manifest's canonical JSON (without its seal and digest)."""
    body = {k: v for k, v in manifest.items() if k not in _UNSIGNED}
    return hmac.new(key, canonical(body), hashlib.sha256).hexdigest()


def check_signature(manifest: Mapping[str, Any], key: bytes, where: str) -> None:
    """``ValueError`` naming ``where`` unless the manifest carries a digest that ``key`` reproduces."""
    stored = manifest.get(DIGEST)
    if stored is None:
        raise ValueError(f"{where} is not signed (no {DIGEST}): it was saved without a key, so it cannot be "
                         "checked against one; load it without key= only if you trust where it came from")
    if not isinstance(stored, str) or not hmac.compare_digest(stored.encode(), sign(manifest, key).encode()):
        raise ValueError(f"{where} fails its HMAC-SHA256 check: the checkpoint was changed after it was saved, or "
                         "the key is not the one it was saved with")
    files = manifest.get("files")
    if not isinstance(files, dict) or any(not isinstance(e, dict) or "sha256" not in e for e in files.values()):
        raise ValueError(f"{where} is signed but does not list every file's SHA-256; it was not written by "
                         "save_checkpoint(..., key=...)")
