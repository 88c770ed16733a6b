"""The one HTTP client of DSec's wire: the SDK (:mod:`dsec.sdk._transport`) and the apiserver's
link to an edge (:mod:`dsec.apiserver.remote_edge`) both send their requests through it.

What it does, once for both:

- one ``aiohttp`` session per client, made on first use (a session belongs to the event loop it
  was made in) with no pool limit: every exec stream and long command holds a connection, and
  a cap would queue the next request behind them;
- a response of 400 or more is raised as the DSec error its body names by ``code``
  (:func:`~dsec.protocol.errors.error_from_wire`), so ``except SandboxNotFound`` works across
  every hop; a body that is not a DSec error is ``InfraFailure(reason="protocol")``;
- a network failure is classified by :func:`unreachable`: ``InfraFailure`` with the one reason
  :attr:`~dsec.protocol.errors.InfraReason.edge_unreachable`, whichever client saw it;
- NDJSON streams: :func:`ndjson_lines` yields the non-blank lines as they arrive,
  :func:`ndjson` parses them into a model and raises an error body sent mid-stream as its error;
- streamed uploads: :func:`send_stream` sends chunks as a body and raises a failure of the
  chunks' own source as itself (the edge link's and the overflow link's ``write_stream``);
- :func:`never_sent` tells a failure that happened before a byte of the request left (the
  server never saw it) from one after. Only the first may be retried without running anything
  twice; ``send(..., retry_unsent=n)`` does that ``n`` times. The default is 0: a create or a
  command must not run twice, so retrying is the caller's decision (the apiserver places a
  refused create on another node instead).

Usage::

    client = WireClient("http://127.0.0.1:8642", {"Authorization": "Bearer k"})
    try:
        async with client.send("GET", "/v1/sandboxes", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            infos = await resp.json()  # reached only for a success; else the typed error is raised
        async with client.send("POST", "/v1/sandboxes/x/exec", data=body) as resp:
            async for event in ndjson(resp, ExecEvent, peer="the server"):
                ...
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise unreachable("GET /v1/sandboxes", exc) from exc
    finally:
        await client.close()

Every request carries an ``X-Request-ID`` (:mod:`dsec.observe.request_ids`): the one of the
request being served (the apiserver calling an edge), or the caller's choice, else a new one;
an error raised from an answer carries the ID as ``request_id``.

``on_response`` sees every response before its status is checked (the edge link checks the
edge's node and epoch headers there). Network failures leave :meth:`WireClient.send` as
aiohttp raised them: the SDK maps them at once with :func:`unreachable`, the edge link first asks
the registry whether the node is lost (:mod:`dsec.apiserver.node_verdict`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aiohttp
from pydantic import BaseModel, ValidationError

from dsec.observe import request_ids
from dsec.protocol.errors import DSecError, InfraFailure, InfraReason, error_from_wire

M = TypeVar("M", bound=BaseModel)
R = TypeVar("R")
Params = Mapping[str, str] | list[tuple[str, str]] | None
# Failures that happen before a single byte of the request left: the server never saw it.
NOT_SENT = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)


def never_sent(exc: BaseException | None) -> bool:
    """Whether the network failure ``exc`` happened before the request left (safe to retry)."""
    return isinstance(exc, NOT_SENT)


def unreachable(what: str, exc: BaseException, peer: str = "") -> InfraFailure:
    """The error for a request ``what`` that failed on the network: the server could not be
    reached, or went away mid-answer. ``peer`` names the server in the message."""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    prefix = f"{peer} is unreachable ({what})" if peer else what
    return InfraFailure(f"{prefix}: {detail}", reason=InfraReason.edge_unreachable)


def _with_request_id(err: DSecError, resp: aiohttp.ClientResponse, sent: str | None) -> DSecError:
    # The body's ID (the server's), else its header's, else the one sent (an older server).
    if err.request_id is None:
        header = resp.headers.get(request_ids.HEADER)
        err.request_id = header if request_ids.valid(header) else sent
    return err


async def wire_error(resp: aiohttp.ClientResponse, sent: str | None = None) -> DSecError:
    """The DSec error an error response (status >= 400) carries, with the request's ID
    (``sent``: the ID the request went out with)."""
    text = await resp.text()
    try:
        body: Any = json.loads(text)
    except ValueError:
        body = text
    return _with_request_id(error_from_wire(resp.status, body), resp, sent)


async def ndjson_lines(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The non-blank lines of a newline-delimited response, as they arrive."""
    async for line in resp.content:
        if line.strip():
            yield line


async def ndjson(resp: aiohttp.ClientResponse, model: type[M], *, peer: str) -> AsyncIterator[M]:
    """The lines of an NDJSON response as ``model``s. A line that is a DSec error body (the
    server failed mid-stream) is raised as its error; a malformed line is ``protocol``."""
    async for line in ndjson_lines(resp):
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise InfraFailure(f"{peer} sent a malformed stream line", reason=InfraReason.protocol) from exc
        if isinstance(obj, dict) and isinstance(obj.get("error"), dict):  # not an event's error
            raise _with_request_id(error_from_wire(500, obj), resp, None)
        try:
            parsed = model.model_validate_json(line)
        except ValidationError as exc:
            # Version skew between the two sides: the platform's fault, not the caller's.
            raise InfraFailure(
                f"{peer} sent a malformed {model.__name__}: {exc}", reason=InfraReason.protocol
            ) from exc
        yield parsed


async def send_stream(
    send: Callable[[AsyncIterator[bytes]], Awaitable[R]], chunks: AsyncIterable[bytes]
) -> R:
    """``send(body)``, ``body`` being ``chunks`` as a request body: aiohttp sends it chunked,
    pulling one chunk at a time, so memory stays flat (a file's upload, any size).

    A failure of ``chunks`` itself is the caller's own: it is raised as itself, however
    aiohttp reported the body that broke (wrapped, or as a broken connection).
    """
    source_error: list[BaseException] = []

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except BaseException as exc:
            source_error.append(exc)
            raise

    try:
        return await send(body())
    except BaseException:
        if source_error:
            raise source_error[0] from None
        raise


class WireClient:
    """Requests to one server at ``url`` (it may move: assign ``url``), with ``headers`` on each.

    ``session_timeout`` is the session's default (each request may pass its own);
    ``on_response`` is called with every response before its status is checked.
    """

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str],
        *,
        session_timeout: aiohttp.ClientTimeout | None = None,
        on_response: Callable[[aiohttp.ClientResponse], None] | None = None,
    ) -> None:
        self.url = url
        self.headers = dict(headers)  # sent with every request of the next session made
        self._session_timeout = session_timeout
        self._on_response = on_response
        self._session: aiohttp.ClientSession | None = None

    @property
    def has_session(self) -> bool:
        return self._session is not None and not self._session.closed

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            kw: dict[str, Any] = {} if self._session_timeout is None else {"timeout": self._session_timeout}
            self._session = aiohttp.ClientSession(
                headers=self.headers, connector=aiohttp.TCPConnector(limit=0), **kw
            )
        return self._session

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    @asynccontextmanager
    async def send(
        self,
        method: str,
        path: str,
        *,
        params: Params = None,
        data: Any = None,
        json_body: Any = None,
        headers: Mapping[str, str] | None = None,
        timeout: aiohttp.ClientTimeout | None = None,
        retry_unsent: int = 0,
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request to ``url + path``; yields the response once it is known to be a success.

        A failure while the caller reads the body (the server dying mid-stream) surfaces
        through the ``yield``. ``retry_unsent``: how many more times to try a request that
        never left (only for requests whose body can be sent again).
        """
        kw: dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        # The request's ID: the caller's (a header given, or the request being served), else new.
        rid = (headers or {}).get(request_ids.HEADER) or request_ids.outgoing()
        headers = {**(headers or {}), request_ids.HEADER: rid}
        attempt = 0
        while True:
            try:
                resp = await self.session().request(
                    method, self.url + path, params=params, data=data, json=json_body, headers=headers, **kw
                )
            except NOT_SENT:
                if attempt >= retry_unsent:
                    raise
                attempt += 1
                continue
            break
        async with resp:
            if self._on_response is not None:
                self._on_response(resp)
            if resp.status >= 400:
                raise await wire_error(resp, rid)
            yield resp
