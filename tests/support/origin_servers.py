"""The tests' view of ``adapter_fabric.harness.origin_servers`` (nginx, moto's S3 server, a Hub endpoint): a server whose
program is not installed skips the test, naming why (scripts/bootstrap.sh installs nginx where it can: as root with apt)."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import ContextManager, Iterator, TypeVar

import pytest

from adapter_fabric.harness import origin_servers as _servers
from adapter_fabric.harness.origin_servers import DRIP_RATE, S3_ENV, HubRepos, hub_endpoint, put_adapter_s3, s3_client

__all__ = ["DRIP_RATE", "S3_ENV", "HubRepos", "hub_endpoint", "moto_s3", "nginx", "put_adapter_s3", "s3_client"]
T = TypeVar("T")


@contextmanager
def _or_skip(manager: ContextManager[T]) -> Iterator[T]:
    with ExitStack() as stack:
        try:
            value = stack.enter_context(manager)
        except _servers.ServerMissing as exc:
            pytest.skip(str(exc))
        yield value


def nginx(root: Path, tmp: Path) -> ContextManager[str]:
    return _or_skip(_servers.nginx(root, tmp))


def moto_s3() -> ContextManager[str]:
    return _or_skip(_servers.moto_s3())
