"""FnCall: short stateless calls into warm pools, the part of :class:`DSecClient` a reward
function or code-execution tool uses (``fncall`` for one, ``fncall_many`` for a batch)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from dsec.protocol.errors import DSecError, InfraFailure, InfraReason
from dsec.protocol.fncall import FnResult, FnTask
from dsec.protocol.models import invalid_request

if TYPE_CHECKING:
    from dsec.sdk._transport import Transport


class FnCalls:
    if TYPE_CHECKING:

        @property
        def _t(self) -> Transport: ...

    async def fncall(
        self, task: FnTask | dict[str, Any], *, pool: str | None = None, timeout: float = 600
    ) -> FnResult:
        """Run one call (python, bash, c or cpp) in a warm pool; see ``FnResult.status``.

        The program's own failures (compile errors, crashes, timeouts, memory) are statuses of
        the result; a ``DSecError`` means the platform could not run it.
        """
        if not isinstance(task, FnTask):
            try:
                task = FnTask.model_validate(task)
            except ValidationError as exc:
                raise invalid_request(exc) from None  # before any request: the caller's mistake
        body = {"task": task.model_dump(mode="json"), "pool": pool, "timeout": timeout}
        answer = await self._t.request("POST", "/v1/fncall", json_body=body, timeout=timeout + 30)
        return FnResult.model_validate(answer)

    async def fncall_many(
        self,
        tasks: Iterable[FnTask | dict[str, Any]],
        *,
        concurrency: int = 32,
        pool: str | None = None,
        timeout: float = 600,
    ) -> list[FnResult | DSecError]:
        """Run many calls, ``concurrency`` at a time; results in the order of ``tasks``.

        One call's platform failure is that call's entry (a ``DSecError``), never the batch's.
        """
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        gate = asyncio.Semaphore(concurrency)

        async def one(task: FnTask | dict[str, Any]) -> FnResult | DSecError:
            async with gate:
                try:
                    return await self.fncall(task, pool=pool, timeout=timeout)
                except DSecError as exc:
                    return exc
                except Exception as exc:  # e.g. a dropped connection
                    return InfraFailure(f"{type(exc).__name__}: {exc}", reason=InfraReason.client)

        return list(await asyncio.gather(*(one(t) for t in tasks)))
