"""``fabric-node``: the entry point of a node process."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Sequence

from adapter_fabric.node.settings import fail, parse_settings


def main(argv: Sequence[str] | None = None) -> None:
    # Start-up (imports, the model, the store) makes ~400k objects that live as long as the node. Collected as they
    # came, they cost a tiny-model node 6-7 full collections (0.5-0.65 s); serve() collects once when the node is
    # built (~0.27 s), then freezes them (server._settle_heap), so later collections skip them too.
    gc.disable()
    try:
        _run(argv)
    finally:
        gc.enable()  # a start that failed, or main() called in-process, leaves the collector on


def _run(argv: Sequence[str] | None) -> None:
    settings = parse_settings(argv)
    from adapter_fabric.observability.logs import setup_logging

    setup_logging(settings.log_format, settings.log_level)
    from adapter_fabric.errors import FabricError
    from adapter_fabric.node.server import serve  # after argument parsing: --help stays instant
    from adapter_fabric.transport import wire

    wire.tune_malloc()  # process-wide; 30-45% faster streams (docs/BENCHMARKS.md)
    try:
        asyncio.run(serve(settings))
    except FabricError as exc:  # bad flags or files found at start: one line, not a traceback
        fail(f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    main()
