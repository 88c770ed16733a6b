"""What every ``dsec`` subcommand shares: consoles, and running one client call with errors
printed the way a shell user expects (a message on stderr, exit status 2)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import typer
from rich.console import Console

from dsec.protocol.errors import DSecError
from dsec.sdk.client import DSecClient

T = TypeVar("T")
console = Console()
err_console = Console(stderr=True)


def _fail(exc: DSecError) -> typer.Exit:
    # The request's ID, when a server answered: what to quote to its operator (the logs name it).
    rid = f" (request {exc.request_id})" if exc.request_id else ""
    err_console.print(f"[red]error:[/red] {exc}{rid}")
    return typer.Exit(code=2)


def _client_call(fn: Callable[[DSecClient], Awaitable[T]]) -> T:
    async def run() -> T:
        async with DSecClient() as client:
            return await fn(client)

    try:
        return asyncio.run(run())
    except DSecError as exc:
        raise _fail(exc) from None
