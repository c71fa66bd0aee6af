"""The node process: ``serve`` builds a node (``adapter_fabric.node.assembly.build_node``), starts it, and drains it on
SIGTERM (or SIGINT); SIGHUP reloads the --policy file (or, without one, is logged and ignored). The node's parts and their order are ``build_node``'s; its life
(start, drain, close) is ``adapter_fabric.node.node.Node``'s.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from concurrent.futures import ThreadPoolExecutor

from adapter_fabric import __version__
from adapter_fabric.node.assembly import build_node
from adapter_fabric.node.settings import NodeSettings
from adapter_fabric.observability import metrics

__all__ = ["serve"]

#: threads for the store's blocking I/O (``NodeContext.io``): they mostly wait on fsync, so more than asyncio's
#: default (cores + 4) lets concurrent Stage calls reach the committer together and share its syncs (group commit)
IO_THREADS = 32


async def serve(settings: NodeSettings) -> None:
    loop = asyncio.get_running_loop()
    loop.set_default_executor(ThreadPoolExecutor(max_workers=IO_THREADS, thread_name_prefix="io"))
    metrics.BUILD.info({"version": __version__})
    node = build_node(settings)
    _settle_heap()
    await node.start()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    # SIGHUP reloads --policy (coalesced, off the loop: node.policy_reloads); without one it is logged and ignored
    loop.add_signal_handler(signal.SIGHUP, node.reloads.on_sighup)
    await stopping.wait()
    await node.drain()
    node.close()


def _settle_heap() -> None:
    """Once the node is built: collect what start-up left and freeze the rest. It lives as long as the node, so no
    later collection needs to scan it (a full one took ~220 ms in a serving tiny-model node, ~3 ms frozen). Then the
    collector goes back on: ``node.main`` turned it off for the start."""
    gc.collect()
    gc.freeze()
    gc.enable()
    metrics.HEAP_FROZEN.set(gc.get_freeze_count())
