"""CurveZMQ keys: making key pairs, reading them back, and the cloud's allow-list of edge keys.

Keys are ZeroMQ's Z85 text (40 characters). Files are pyzmq's certificate format: ``NAME.key``
holds the public key and may be shared; ``NAME.key_secret`` holds both and must stay private
(it is written with mode 0600). Nothing here knows anything about splitft.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from .errors import TransportError

log = logging.getLogger(__name__)

Key = bytes  # a Z85-encoded CURVE key, 40 bytes


def generate_keypair(directory: str | os.PathLike, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public) and ``NAME.key_secret`` (secret, mode 0600) into ``directory``.

    Refuses to overwrite existing files: replacing a key silently would lock out every peer
    that trusts the old one.
    """
    if not zmq.has("curve"):
        raise TransportError("this libzmq was built without CURVE support; install pyzmq's wheels")
    if not name or "/" in name or name.startswith("."):
        raise TransportError(f"a key name is a plain file name such as 'edge1', got {name!r}")
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise TransportError(f"{path} exists; choose another name or delete it first")
    public_file, secret_file = zmq.auth.create_certificates(folder, name)
    os.chmod(secret_file, 0o600)
    return Path(public_file), Path(secret_file)


def _load(path: str | os.PathLike) -> tuple[Key, Key | None]:
    file = Path(path)
    if not file.is_file():
        raise TransportError(f"no key file at {file} (make one with `splitft keys`)")
    try:
        public, secret = zmq.auth.load_certificate(file)
    except (ValueError, OSError) as exc:
        raise TransportError(f"{file} is not a CURVE key file ({exc}); make one with `splitft keys`") from None
    if not public or len(public) != 40:
        raise TransportError(f"{file} holds no valid public key")
    return public, secret


def load_public_key(key: str | os.PathLike | Key) -> Key:
    """A public key from a ``.key`` / ``.key_secret`` file, or a Z85 key given directly."""
    if isinstance(key, bytes):
        return _check_z85(key, "public")
    return _load(key)[0]


def load_secret_key(key: str | os.PathLike | Key) -> tuple[Key, Key]:
    """``(public, secret)`` from a ``.key_secret`` file, or from a Z85 secret key given directly."""
    if isinstance(key, bytes):
        secret = _check_z85(key, "secret")
        return zmq.curve_public(secret), secret
    public, secret = _load(key)
    if not secret:
        raise TransportError(f"{key} holds only a public key; give the matching .key_secret file")
    return public, secret


def load_allowed_keys(sources: Iterable[str | os.PathLike | Key]) -> set[Key]:
    """Public keys from files, folders (every ``*.key`` inside) and Z85 keys, as one set."""
    keys: set[Key] = set()
    for source in sources:
        if isinstance(source, bytes):
            keys.add(load_public_key(source))
            continue
        path = Path(source)
        if path.is_dir():
            files = sorted(path.glob("*.key"))
            if not files:
                raise TransportError(f"no *.key public key files in {path}")
            keys.update(_load(f)[0] for f in files)
        else:
            keys.add(_load(path)[0])
    return keys


def _check_z85(key: Key, what: str) -> Key:
    if len(key) != 40:
        raise TransportError(f"a Z85 {what} key is 40 characters, got {len(key)}")
    try:
        z85.decode(key)
    except (ValueError, KeyError):
        raise TransportError(f"the {what} key is not valid Z85 text") from None
    return key


class KeyAllowList:
    """ZAP credentials check for :class:`zmq.auth.thread.ThreadAuthenticator`: known keys pass
    (``keys`` None: every key passes, and the connection's key is still known to the server).

    ``on_refused`` hears about each refusal (with the key), so the operator sees who knocked.
    """

    def __init__(self, keys: Iterable[Key] | None, on_refused: Callable[[str], None] | None = None) -> None:
        self.keys = None if keys is None else frozenset(keys)
        self.on_refused = on_refused

    def callback(self, domain: str, key: Key) -> bool:
        if self.keys is None or key in self.keys:
            return True
        text = key.decode("ascii", "replace")
        log.warning("refused an edge with unknown CURVE key %s", text)
        if self.on_refused is not None:
            self.on_refused(f"refused an edge whose key {text} is not in the allow-list")
        return False
