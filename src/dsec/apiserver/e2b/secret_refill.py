"""A secret changed: the running sandboxes whose egress headers name it follow.

E2B's egress resolves ``${e2b.secrets.<name>}`` at each request, so ``Secret.update`` reaches
sandboxes already running; DSec fills the values in when the headers are set, so an update
hands the new value to every live sandbox of the secret's project whose headers name it (its
network rules set again, unchanged, with the headers and their secrets), and a delete takes
the headers that named it away (a request then leaves without them, as E2B's fails to
resolve; a host left with no header is spliced end to end again). Done before the answer:
when ``Secret.update`` returns, requests carry the new value.
"""

from __future__ import annotations

import asyncio
import logging

from dsec.apiserver.e2b.secret_store import SecretStore
from dsec.apiserver.sandboxes import SandboxRoutes
from dsec.protocol.egress_headers import used
from dsec.protocol.errors import DSecError
from dsec.protocol.models import SandboxInfo, SandboxState

log = logging.getLogger(__name__)

_LIVE = (SandboxState.running, SandboxState.paused)


class SecretRefill:
    def __init__(self, sandboxes: SandboxRoutes, store: SecretStore) -> None:
        self.sandboxes = sandboxes
        self.store = store

    async def changed(self, project: str, name: str, deleted: bool = False) -> None:
        links = list(self.sandboxes.links.values())
        answers = await asyncio.gather(*(ln.list_sandboxes(None) for ln in links), return_exceptions=True)
        naming = [
            i
            for a in answers
            if not isinstance(a, BaseException)
            for i in a
            if i.project == project and i.state in _LIVE and name in used(i.egress_headers)
        ]
        await asyncio.gather(*(self._refill(info, name, deleted) for info in naming))

    async def _refill(self, info: SandboxInfo, name: str, deleted: bool) -> None:
        headers = info.egress_headers
        if deleted:  # the headers naming it go, and a host left with none (spliced again)
            kept = {
                host: {h: v for h, v in hs.items() if name not in used({host: {h: v}})}
                for host, hs in headers.items()
            }
            headers = {host: hs for host, hs in kept.items() if hs}
        try:
            values = await self.store.resolve(info.project, used(headers))
            link = self.sandboxes.link_for(info.id)
            await link.set_network_rules(info.id, info.network_rules, headers, values)
        except DSecError as exc:  # stopped meanwhile, or another of its secrets is gone too
            log.warning("secret %s changed: %s keeps its egress headers as they were: %s", name, info.id, exc)
