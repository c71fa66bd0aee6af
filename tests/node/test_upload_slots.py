"""Upload slots (``node.upload_slots``, ``--upload-slots``): at most N Fetch streams send at once, the others wait their
turn, one that waited the bound sends anyway, and a slot goes back at the lease's end; a real seed with one slot
serves a second stream while a slow reader holds the first."""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.node.upload_slots import UploadSlots
from adapter_fabric.observability.metrics import UPLOAD_SLOT_WAITS
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.transport import wire
from adapter_fabric.v1 import fabric_pb2
from tests.support.scrape import scrape
from tests.transport.test_pull_causes import ALL, SMALL_WINDOW


def waits(outcome: str) -> float:
    return UPLOAD_SLOT_WAITS.labels(outcome)._value.get()


async def hog(slots: UploadSlots, release: asyncio.Event) -> asyncio.Task:
    """A stream that takes a slot and keeps sending (a peer reading slowly) until ``release``; returned once it holds it."""
    held = asyncio.Event()

    async def stream() -> None:
        async with slots.slot():
            held.set()
            await release.wait()

    task = asyncio.create_task(stream())
    await held.wait()
    return task


async def one_slot_left(slots: UploadSlots) -> None:
    """Every holder gone, exactly one slot is free: a second holder beside the first would mean one was given back twice
    (its lease, when it has one, is longer than the 0.02 s this waits)."""
    async with slots.slot():
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(slots.slot().__aenter__(), 0.02)


def test_at_most_n_send_at_once_and_the_others_go_in_the_order_they_asked() -> None:
    async def main() -> tuple[int, list[int]]:
        slots = UploadSlots(2, wait_s=30.0)
        inside, most, order = 0, 0, []
        gate = asyncio.Event()

        async def stream(n: int) -> None:
            nonlocal inside, most
            async with slots.slot():
                inside += 1
                most = max(most, inside)
                order.append(n)
                await (gate.wait() if n < 2 else asyncio.sleep(0.01))
                inside -= 1

        tasks = []
        for n in range(6):
            tasks.append(asyncio.create_task(stream(n)))
            await asyncio.sleep(0)  # each asks in turn
        await asyncio.sleep(0.05)
        assert order == [0, 1]  # two hold the slots; four wait
        gate.set()
        await asyncio.gather(*tasks)
        return most, order

    queued = waits("queued")
    most, order = asyncio.run(main())
    assert most == 2 and order == [0, 1, 2, 3, 4, 5]
    assert waits("queued") == queued + 4


def test_a_stream_that_waited_the_bound_sends_without_a_slot_and_gives_back_none() -> None:
    async def main() -> None:
        slots = UploadSlots(1, wait_s=0.05)
        release = asyncio.Event()
        hogging = await hog(slots, release)
        async with slots.slot():  # waits 0.05 s, then goes on: it did not starve
            pass
        release.set()
        await hogging
        await one_slot_left(slots)

    past = waits("past_bound")
    asyncio.run(main())
    assert waits("past_bound") == past + 1


def test_a_slow_stream_gives_its_slot_back_when_the_lease_ends_and_only_once() -> None:
    async def main() -> None:
        slots = UploadSlots(1, wait_s=30.0, lease_s=0.2)
        release = asyncio.Event()
        hogging = await hog(slots, release)  # it reads slowly for longer than a lease
        async with slots.slot():  # in turn, once the hog's lease ends: well before the 30 s wait bound
            pass
        release.set()
        await hogging  # its slot went back at the lease's end: not again now
        await one_slot_left(slots)

    queued, past = waits("queued"), waits("past_bound")
    asyncio.run(main())
    assert waits("queued") == queued + 1 and waits("past_bound") == past


def test_a_stream_cancelled_while_it_waits_takes_no_slot() -> None:
    async def main() -> None:
        slots = UploadSlots(1, wait_s=30.0)
        async with slots.slot():
            waiting = asyncio.create_task(slots.slot().__aenter__())
            await asyncio.sleep(0.01)
            waiting.cancel()  # the puller went away while it waited
            with pytest.raises(asyncio.CancelledError):
                await waiting
        async with asyncio.timeout(1):  # the slot is free again: taken at once
            async with slots.slot():
                pass

    asyncio.run(main())


@pytest.mark.slow
def test_a_seed_with_one_slot_serves_a_second_stream_while_a_slow_reader_holds_it(tmp_path: Path) -> None:
    adapter = make_peft_adapter(tmp_path / "a", base_model=build_tiny_model(), r=16, lora_alpha=16, target_modules=ALL, seed=43)
    with LocalNode(tmp_path / "seed", model="none", port=free_port(),
                   extra_args=["--chunk-size", "4096", "--upload-slots", "1", "--metrics-listen", "127.0.0.1:0"]) as seed:  # fmt: skip
        with seed.client() as client:
            manifest = client.manifest(client.stage(adapter, "a").adapter_id)
        request = fabric_pb2.FetchRequest(digest=manifest.digest, file=manifest.weights.name, offset=0, length=manifest.weights.size)
        with grpc.insecure_channel(seed.address, options=SMALL_WINDOW) as slow, grpc.insecure_channel(seed.address) as other:
            held = wire.fetch_stub(slow)(request)
            next(held)  # it reads one message and no more: the seed's one slot stays taken
            chunks = list(wire.fetch_stub(other)(request, timeout=60))  # waits its turn, 1 s at most, then is served whole
            held.cancel()
        assert sum(len(data) for _, data in chunks) == manifest.weights.size
        samples = scrape(seed)  # it took the slot when the held stream's lease ended, before its own wait bound
        assert samples[("fabric_upload_slot_waits_total", frozenset({("outcome", "queued")}))] == 1
