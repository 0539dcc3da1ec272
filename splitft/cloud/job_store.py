"""The job's key-value store, as the ranks of a cloud use it: every value signed with the job's secret.

torch's TCPStore (torchrun's, or the one rank 0 hosts) answers anyone who reaches its port, and
reads and writes are not authenticated. What the ranks keep there steers edges: where each rank
listens (the front door redirects edges to it), whether it is alive or stopped (placement), which
rank holds a session, how many sessions the job has ended (``--sessions``). So each rank signs
what it writes with a secret only the job's processes know (HMAC-SHA256 over the key and the
value), and reads back only what carries that signature: a value written by anyone else is
ignored, as if it were absent, and logged.

The secret comes from the environment, ``SPLITFT_JOB_SECRET``, which every rank of the job must
share: ``splitft cloud --workers N`` makes one for its ranks; under torchrun, set it on every node
(``export SPLITFT_JOB_SECRET=$(python -c 'import secrets; print(secrets.token_hex(32))')``).
Signing stops forged values, not someone who can reach the store from deleting keys or replaying
a rank's older values (heartbeats carry a counter, so an older one is ignored): keep the store's
port (``MASTER_PORT``, torchrun's rendezvous endpoint) on a network that edges cannot reach.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from collections.abc import Mapping

import torch.distributed as dist

from ..errors import ConfigError

log = logging.getLogger(__name__)

SECRET_ENV = "SPLITFT_JOB_SECRET"
_MIN_SECRET_CHARS = 16


def job_secret(environ: Mapping[str, str] = os.environ) -> bytes:
    """The job's secret, from ``SPLITFT_JOB_SECRET``; a ConfigError saying how to set it when absent."""
    secret = environ.get(SECRET_ENV, "")
    if len(secret) < _MIN_SECRET_CHARS:
        raise ConfigError(
            f"the ranks of a cloud sign what they write in the job's store with a secret they share: set "
            f"{SECRET_ENV} to the same random value (at least {_MIN_SECRET_CHARS} characters) for every rank, e.g. "
            f"export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(32))') "
            "('splitft cloud --workers N' makes one itself)")
    return secret.encode()


def ensure_job_secret() -> None:
    """Give the ranks this process is about to launch a fresh secret, unless one is set already."""
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(32))


class SignedStore:
    """A torch.distributed store under ``prefix`` whose values are signed and checked.

    Values are text; one is stored as ``MAC.VALUE`` with ``MAC`` the HMAC-SHA256 of the full key
    and the value, so a value cannot be moved to another key either. Store failures raise
    ``RuntimeError``, as torch's do; the caller decides what a failure means.
    """

    def __init__(self, store: dist.Store, prefix: str, secret: bytes) -> None:
        self._store = dist.PrefixStore(prefix, store)
        self._prefix, self._secret = prefix, secret
        self._warned = -float("inf")

    def _mac(self, key: str, value: str) -> str:
        message = f"{self._prefix}/{key}".encode() + b"\0" + value.encode()
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def sealed(self, key: str, value: str) -> str:
        """What is stored for ``value`` under ``key``."""
        return f"{self._mac(key, value)}.{value}"

    def get(self, key: str) -> str | None:
        """The value under ``key``; None when there is none, or it is not signed by this job."""
        if not self._store.check([key]):
            return None
        raw = self._store.get(key).decode(errors="replace")
        if not raw:
            return None
        mac, _, value = raw.partition(".")
        if hmac.compare_digest(mac, self._mac(key, value)):
            return value
        self._forged(key)
        return None

    def set(self, key: str, value: str) -> None:
        self._store.set(key, self.sealed(key, value))

    def compare_set(self, key: str, expected: str, desired: str) -> None:
        """Replace ``expected`` (a value this job wrote) with ``desired``, atomically."""
        self._store.compare_set(key, self.sealed(key, expected), self.sealed(key, desired))

    def _forged(self, key: str) -> None:
        now = time.monotonic()
        if now - self._warned > 30:
            self._warned = now
            log.warning("a value in the job's store under %s/%s is not signed with this job's secret: ignored "
                        "(someone else can write to the store; keep its port away from edges)", self._prefix, key)


__all__ = ["SECRET_ENV", "SignedStore", "ensure_job_secret", "job_secret"]
