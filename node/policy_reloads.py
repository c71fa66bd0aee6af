"""Reloads of the --policy file (SIGHUP, or the file changed on disk): coalesced, and parsed off the event loop.

A signal only asks for a reload. One task runs them, one at a time, on an I/O thread, and runs one more once
the last ends if any was asked meanwhile: at most one parse is in flight, and the file as it is when a parse
starts wins. (A storm of 1,000 SIGHUPs to a node with a 1,000-principal policy, 392 KB, parsed it once per
signal on the event loop: no RPC was answered for ~30 s.) Without --policy, SIGHUP is logged once and ignored:
its default action ended the node with no drain and nothing logged.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from adapter_fabric.access.policy import Policy
from adapter_fabric.access.policy_file import PolicyFile
from adapter_fabric.observability.logs import StateLog

log = logging.getLogger("fabric.node")


class PolicyReloads:
    """Asks (``on_sighup``, from the event loop) and the one loop that reloads (``run``)."""

    def __init__(
        self, policy: PolicyFile | None, io: Callable[..., Awaitable[Any]], applied: Callable[[Policy], None] | None = None
    ) -> None:
        """``policy``: the file in force (None: the node has none); ``io``: runs a blocking call on an I/O thread;
        ``applied``: told each policy a reload puts in force (the node hands the store its new [[quota]] tables)."""
        self.policy = policy
        self._io = io
        self._applied = applied
        self._asked = asyncio.Event()
        self._why = ""
        self._states = StateLog(log)

    def on_sighup(self) -> None:
        """A SIGHUP (on the event loop): a reload asked, or, without a policy, one line the first time and nothing after."""
        if self.policy is None:
            self._states.note("sighup", "ignored", "SIGHUP ignored: this node has no --policy to reload (later ones are ignored without a word)",
                              logging.WARNING)
            return
        self._why = "SIGHUP"
        self._asked.set()

    async def run(self, poll_s: float) -> None:
        """Reload when asked, and when the file changed (checked every ``poll_s``), one parse at a time, until cancelled."""
        assert self.policy is not None
        while True:
            try:
                await asyncio.wait_for(self._asked.wait(), poll_s)
            except TimeoutError:
                await self._io(self._reload, None)
                continue
            self._asked.clear()  # a signal from here on asks for one more parse, after this one
            await self._io(self._reload, self._why)

    def _reload(self, why: str | None) -> None:
        """On an I/O thread: read the file again (when asked, or when it changed: ``why`` None) and apply what took effect."""
        assert self.policy is not None
        took = self.policy.reload(why) if why is not None else self.policy.reload_if_changed()
        if took and self._applied is not None:
            self._applied(self.policy.policy)
