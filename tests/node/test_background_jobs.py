"""A node's background job that fails is said at once: its task is held until drain cancels it and never awaited, so
the failure would otherwise surface only as asyncio's "exception was never retrieved" at exit, if at all."""

from __future__ import annotations

import asyncio
import logging

from adapter_fabric.node import background


async def test_a_background_job_that_fails_is_logged_at_once_and_one_cancelled_or_ended_is_not(caplog) -> None:
    async def watch_the_members() -> None:
        raise OSError("the store's refs/ went away")

    async def collect_once() -> None:
        return None

    async def run_until_cancelled() -> None:
        await asyncio.sleep(3600)

    caplog.set_level(logging.ERROR, logger="fabric.node")
    failed, ended, cancelled = (background.start(job()) for job in (watch_the_members, collect_once, run_until_cancelled))
    await asyncio.sleep(0.01)
    cancelled.cancel()
    await asyncio.gather(failed, ended, cancelled, return_exceptions=True)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert "watch_the_members failed, and no longer runs" in errors[0].getMessage() and "refs/ went away" in caplog.text
