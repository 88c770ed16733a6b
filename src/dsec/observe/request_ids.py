"""Request IDs: one ID follows one request from the SDK through the apiserver to the edge.

The ID lives in a context variable (:data:`REQUEST_ID`). A server's middleware
(:func:`dsec.observe.logs.request_middleware`) sets it from the request's ``X-Request-ID``
header when that is well formed (:func:`valid`), else to a fresh one; every log line written
while the request is handled carries it, and :class:`~dsec.protocol.wire_client.WireClient`
sends it on every request made meanwhile (the apiserver's calls to the edge), so the edge logs
the same ID. Outside a request (the SDK, a background task) each request gets a fresh ID,
unless the caller chose one::

    with request_id("job-17-step-3"):
        await sandbox.files.stat("/missing")   # sent as X-Request-ID: job-17-step-3

The ID comes back on every response (the header) and in every error body (``request_id``),
and :class:`~dsec.protocol.errors.DSecError` exposes it as ``err.request_id``, so a user can
quote it to an operator, who finds every line of that request in the logs.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from dsec.protocol.errors import InvalidRequest

HEADER = "X-Request-ID"
MAX_LEN = 128
# What a server takes from a client: bounded, and nothing a log line or a header could be
# split or forged with (no spaces, quotes, control characters, newlines).
_VALID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0," + str(MAX_LEN - 1) + "}")

REQUEST_ID: ContextVar[str | None] = ContextVar("dsec_request_id", default=None)


def valid(value: str | None) -> bool:
    """Whether ``value`` is an ID a server accepts from a client: 1 to 128 characters of
    ``A-Za-z0-9._:-``, starting with a letter or digit."""
    return value is not None and _VALID.fullmatch(value) is not None


def new_id() -> str:
    """A fresh ID: 128 random bits in hex (as a UUID's worth, without the dashes).

    From ``random``, not ``secrets``: an ID correlates log lines and grants nothing, and the
    system call behind ``secrets`` was a tenth of what a GET cost the apiserver."""
    return f"{random.getrandbits(128):032x}"


def current() -> str | None:
    """The ID of the request being handled (or chosen by the caller), if any."""
    return REQUEST_ID.get()


def accept(value: str | None) -> str:
    """The ID a server uses for a request that sent ``value``: it, if well formed, else a new one
    (a malformed one is dropped, not repaired: it may be anything a client sent)."""
    return value if value is not None and valid(value) else new_id()


def outgoing() -> str:
    """The ID to send on a request about to leave: the current one, else a fresh one."""
    return REQUEST_ID.get() or new_id()


@contextmanager
def request_id(value: str) -> Iterator[str]:
    """Send ``value`` as the ID of every request made inside the block (``InvalidRequest`` if
    a server would not accept it)."""
    if not valid(value):
        raise InvalidRequest(f"a request ID is 1-{MAX_LEN} characters of A-Za-z0-9._:- (got {value[:40]!r})")
    token = REQUEST_ID.set(value)
    try:
        yield value
    finally:
        REQUEST_ID.reset(token)
