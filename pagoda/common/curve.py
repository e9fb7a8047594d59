"""Optional CurveZMQ between the scheduler and the worker, for a step protocol that
crosses a network: encryption plus mutual authentication by public key.

The scheduler's ROUTER is the CURVE server; it admits only workers whose public key sits
in its authorized-keys directory (checked by its ZAP handler). Each worker is a CURVE
client that knows the scheduler's public key, so it never talks to an impostor. Keys are
ZeroMQ certificate files: `NAME.key` (public, safe to copy) and `NAME.key_secret`.

    python -m pagoda.common.curve DIR NAME     # writes DIR/NAME.key and DIR/NAME.key_secret (0600)

It never replaces an existing key file: a key pair is replaced by removing the old one.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from pagoda.common.secret_files import create_exclusive, exposure_warning

log = logging.getLogger("pagoda.curve")


class CurveKeyError(ValueError):
    """A key file is missing, unreadable or of the wrong kind; the message says which."""


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes


def load_key_pair(path: str | Path) -> KeyPair:
    """This process's own keys, from a `.key_secret` certificate."""
    public, secret = _load(path)
    if secret is None:
        raise CurveKeyError(f"{path} holds no secret key (give the .key_secret file)")
    warning = exposure_warning(path, "the CURVE secret key")
    if warning is not None:
        log.warning("%s", warning)
    return KeyPair(public, secret)


def load_public_key(path: str | Path) -> bytes:
    """A peer's public key, from its `.key` (or `.key_secret`) certificate."""
    return _load(path)[0]


def load_authorized_keys(directory: str | Path) -> frozenset[bytes]:
    """The public keys (Z85) of every `*.key` certificate in `directory`; at least one."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CurveKeyError(f"{directory} is not a directory of public keys")
    keys = frozenset(load_public_key(path) for path in sorted(directory.glob("*.key")))
    if not keys:
        raise CurveKeyError(f"{directory} holds no *.key public key files")
    return keys


def z85_of(raw_key: bytes) -> bytes:
    """The Z85 text of a raw 32-byte key, as the ZAP handler receives them."""
    return z85.encode(raw_key)


def make_server(socket: zmq.Socket, keys: KeyPair) -> None:
    """Before bind: this socket accepts only CURVE peers (and asks ZAP which ones)."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True


def make_client(socket: zmq.Socket, keys: KeyPair, server_public_key: bytes) -> None:
    """Before connect: encrypt to, and authenticate, the server holding that public key."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_serverkey = server_public_key


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    path = Path(path)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"cannot read the CURVE key file {path}: {exc}") from None
    if public is None or len(public) != 40:
        raise CurveKeyError(f"{path} is not a ZeroMQ CURVE certificate")
    return public, secret


def write_key_pair(directory: Path, name: str) -> tuple[Path, Path]:
    """Write directory/name.key (0644) and directory/name.key_secret (0600 from its first
    byte, whatever the umask) in ZeroMQ's certificate format; CurveKeyError if either
    exists."""
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public_path, secret_path):
        if path.exists() or path.is_symlink():
            raise CurveKeyError(f"{path} exists; remove the old key pair to replace it")
    public, secret = zmq.curve_keypair()
    created = datetime.now(UTC).isoformat(timespec="seconds")
    lines = [f"#   ZeroMQ CURVE certificate, written by pagoda on {created}", "metadata", "curve"]
    public_line = f'    public-key = "{public.decode()}"'
    secret_line = f'    secret-key = "{secret.decode()}"'
    try:
        create_exclusive(secret_path, "\n".join([*lines, public_line, secret_line, ""]), 0o600)
        create_exclusive(public_path, "\n".join([*lines, public_line, ""]), 0o644)
    except FileExistsError as exc:  # created meanwhile by someone else
        raise CurveKeyError(
            f"{exc.filename} exists; remove the old key pair to replace it"
        ) from None
    return public_path, secret_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pagoda.common.curve", description="Write a CurveZMQ key pair for Pagoda."
    )
    parser.add_argument("directory", type=Path, help="where to write the two files")
    parser.add_argument("name", help="file stem, e.g. scheduler or worker-1")
    args = parser.parse_args(argv)
    if not zmq.has("curve"):
        parser.error("this libzmq was built without CURVE support")
    args.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    if os.stat(args.directory).st_mode & 0o022:
        parser.error(
            f"{args.directory} is writable by others, who could replace the keys; "
            "use a directory only its owner can write"
        )
    try:
        public_path, secret_path = write_key_pair(args.directory, args.name)
    except CurveKeyError as exc:
        parser.error(str(exc))
    print(f"public key (copy to the peer): {public_path}")
    print(f"secret key (keep here):        {secret_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
