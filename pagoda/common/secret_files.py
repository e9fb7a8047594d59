"""Files that hold secrets (API keys, CURVE secret keys, the TLS key): created readable by
their owner only, never over an existing file, and a warning when one loaded is readable by
anyone else (security review N12)."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def exposure_warning(path: str | Path, what: str) -> str | None:
    """A sentence when the file at `path` is readable or writable by group or others."""
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return None  # reading it reports the problem
    if not mode & 0o077:
        return None
    return (
        f"{what} {path} is open to users other than its owner (mode {mode:04o}); "
        f"run chmod 600 {path}"
    )


def create_exclusive(path: Path, text: str, mode: int) -> None:
    """Write a new file with `mode` from its first byte (O_EXCL: an existing file, or a
    link planted in its place, is an error, never overwritten)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        file.write(text)
