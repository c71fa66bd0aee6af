"""What every RPC group of the node shares: the store, the model, the known peers, and the threads work runs on.

Threads, and what may block them:
- the event loop: never blocks; it only moves messages;
- the default thread pool (``io``): store I/O, hashing and peer pulls;
- one model worker thread (``on_model``): swaps at the quiescent point and
  forwards. It never waits on the network or the disk (docs/ARCHITECTURE.md
  invariant 7), so while a pull runs, Generate keeps answering with the
  resident adapters.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

from adapter_fabric.errors import AdapterNotFound, AdaptersUnsupported
from adapter_fabric.node.in_use import InUse
from adapter_fabric.store import AdapterStore
from adapter_fabric.transport.discovery import PeerSource

if TYPE_CHECKING:  # the model module loads torch: named for the type checker only
    from adapter_fabric.serving.multi_lora import MultiLoraModel

T = TypeVar("T")


class NodeContext:
    """The store, the model (None on a store-only node), the peer source, and the I/O and model-worker threads.

    Handed to each RPC group; it holds no RPC state of its own.
    """

    def __init__(self, store: AdapterStore, model: MultiLoraModel | None, peer_source: PeerSource) -> None:
        self.store = store
        self.model = model
        # Known peers: the static list plus a DNS name, re-resolved on every use (adapter_fabric.transport.discovery).
        self.peer_source = peer_source
        self._model_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        #: adapters being served, pulled or loaded now: an evicting store never drops them (``adapter_fabric.node.eviction``)
        self.in_use = InUse()

    def close(self) -> None:
        """Let the model worker finish its queued jobs, then stop it."""
        self._model_worker.shutdown(wait=True)

    async def io(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` on the default thread pool: store I/O, hashing, peer pulls.

        A file missing, or an id not found, because the store was deleted under the running node is ``StoreMissing``
        naming the store (an operator's fault to fix), never an UNKNOWN with a traceback, nor "not staged".
        """
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except (FileNotFoundError, AdapterNotFound):
            await asyncio.to_thread(self.store.check_present)
            raise

    async def io_cleanup(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``io`` for clean-up that must happen: a cancel of the caller's RPC (a client cut its stream) meanwhile
        would otherwise withdraw the job before a thread took it, leaving, say, an upload held for good."""
        return await asyncio.shield(self.io(fn, *args, **kwargs))

    async def on_model(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn`` on the one model worker thread, after the jobs queued before it."""
        return await asyncio.get_running_loop().run_in_executor(self._model_worker, partial(fn, *args, **kwargs))

    def after_model_jobs(self, fn: Callable[[], Any]) -> Future:
        """Queue ``fn`` on the model worker without waiting: it runs after every job queued so far, even if the caller is cancelled."""
        return self._model_worker.submit(fn)

    def require_model(self, what: str) -> MultiLoraModel:
        """The model; a store-only node refuses ``what`` by name."""
        if self.model is None:
            raise AdaptersUnsupported(f"this node is store-only (started with --model none): it cannot {what}; use a node with a model")
        return self.model

    async def known_peers(self) -> list[str]:
        """The peers known now (DNS re-resolved off the event loop)."""
        return await self.io(self.peer_source.peers)
