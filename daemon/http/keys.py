"""API keys for the HTTP APIs: created by `meshd api-key create`, stored hashed.

A key is `msk_` + 32 random bytes (URL-safe base64). Only its SHA-256 is stored, in
`<state_dir>/api_keys.json` (mode 0600): the keys are long random strings, so a fast hash
cannot be reversed by guessing, and a stolen file gives no working key. The CLI writes the
file (atomically: a temporary file renamed over it) while the daemon runs; the daemon checks
the file's identity on every request and re-reads it when it changed, so a created key works
and a revoked key stops working at once, without a restart or any call into the daemon.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

KEYS_FILE = "api_keys.json"
KEY_PREFIX = "msk_"
SHOWN_CHARS = 8  # how much of a key `list` shows, to tell keys apart


class ApiKeyError(ValueError):
    """A key operation cannot be done (unknown key, bad name); the message says why."""


@dataclass(frozen=True)
class ApiKey:
    """One stored key: never the key itself, only its hash and a short visible prefix."""

    key_id: str
    name: str
    sha256: str
    shown: str  # the first characters of the key, e.g. "msk_Ab3dE"
    created_at: float


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeyStore:
    """The keys file of one state directory (thread-safe; cheap to check per request)."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / KEYS_FILE
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._keys: tuple[ApiKey, ...] = ()

    # ---------------------------------------------------------------- reading

    def keys(self) -> tuple[ApiKey, ...]:
        """The current keys (re-read when the file changed since the last look)."""
        try:
            info = os.stat(self.path)
        except FileNotFoundError:
            with self._lock:
                self._seen, self._keys = None, ()
            return ()
        identity = (info.st_ino, info.st_mtime_ns, info.st_size)
        with self._lock:
            if identity != self._seen:
                self._keys = self._read()
                self._seen = identity
            return self._keys

    def _read(self) -> tuple[ApiKey, ...]:
        try:
            data = json.loads(self.path.read_text())
            return tuple(ApiKey(**entry) for entry in data.get("keys", []))
        except (OSError, ValueError, TypeError) as exc:
            raise ApiKeyError(
                f"the API key file {self.path} is unreadable ({exc}); fix or delete it and "
                "create keys again with `meshd api-key create`"
            ) from exc

    def verify(self, presented: str) -> ApiKey | None:
        """The stored key `presented` matches, or None (constant time per stored key)."""
        if not presented.startswith(KEY_PREFIX):
            return None
        digest = _hash(presented)
        found = None
        for key in self.keys():
            if hmac.compare_digest(key.sha256, digest):
                found = key
        return found

    # ---------------------------------------------------------------- writing (the CLI)

    def create(self, name: str) -> tuple[ApiKey, str]:
        """A new key named `name`; returns the stored entry and the key (shown once)."""
        name = name.strip()
        if not name or len(name) > 64:
            raise ApiKeyError("give the key a name of 1-64 characters (e.g. the client using it)")
        if any(key.name == name for key in self.keys()):
            raise ApiKeyError(f"a key named {name!r} exists; revoke it or choose another name")
        secret = KEY_PREFIX + secrets.token_urlsafe(32)
        entry = ApiKey(
            key_id=secrets.token_hex(4),
            name=name,
            sha256=_hash(secret),
            shown=secret[: len(KEY_PREFIX) + SHOWN_CHARS],
            created_at=time.time(),
        )
        self._write((*self.keys(), entry))
        return entry, secret

    def revoke(self, name_or_id: str) -> ApiKey:
        keys = self.keys()
        match = [key for key in keys if name_or_id in (key.key_id, key.name)]
        if not match:
            known = ", ".join(f"{k.name} ({k.key_id})" for k in keys) or "none"
            raise ApiKeyError(f"no API key is named or has id {name_or_id!r}; keys: {known}")
        self._write(tuple(key for key in keys if key is not match[0]))
        return match[0]

    def _write(self, keys: tuple[ApiKey, ...]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        body = json.dumps({"keys": [asdict(key) for key in keys]}, indent=2)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".api_keys.")
        try:
            with os.fdopen(fd, "w") as fh:
                os.fchmod(fh.fileno(), 0o600)
                fh.write(body)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
