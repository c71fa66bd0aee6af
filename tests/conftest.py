"""What every test shares. Helpers live in tests/support/ (imported as ``tests.support.*``); fixtures shared
by several folders live here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from adapter_fabric.store.lock_watch import CHECK_VARIABLE
from tests.support.store import make_adapters

# Invariant 17 checked in every test and every node process a test starts (they inherit the environment): a network
# call, HTTP read or engine call made while a store lock is held raises instead of waiting (adapter_fabric.store.lock_watch).
os.environ[CHECK_VARIABLE] = "1"


@pytest.fixture(scope="session")
def store_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real PEFT adapters and hand-broken copies of them (tests.support.store.make_adapters), made once per session.

    Read-only for every test: a test that damages one copies it first.
    """
    return make_adapters(tmp_path_factory.mktemp("store-adapters"))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules with slow tests first, the quick ones after (stable: the order within a module is kept).

    scripts/test spreads modules over pytest-xdist workers in this order (--dist loadfile): long
    modules first and hundreds of sub-second ones last, so the workers finish together instead of
    one of them ending the run alone on a module of node processes.
    """
    slow_modules = {item.module for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module not in slow_modules)
