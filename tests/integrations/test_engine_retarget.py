"""node.engine_retarget's choices over plain data: which engine cards it unloads after a move and in a round, and which
origin ids it revalidates for the engines (the HTTP side runs against vLLM's serving layer in test_vllm_retarget.py)."""

from __future__ import annotations

from adapter_fabric.integrations.engine_models import EngineList, EngineLoRA
from adapter_fabric.node.engine_retarget import EngineRetarget
from adapter_fabric.store.export import version_name

OLD, NEW = "a" * 64, "b" * 64
EXPORT = "/srv/export"


def _retarget(cards: list[EngineLoRA], current: dict[str, str], stale: set[str]) -> tuple[EngineRetarget, list[tuple[str, str]]]:
    unloaded: list[tuple[str, str]] = []

    def unload(url: str, name: str) -> bool:
        unloaded.append((url, name))
        return True

    retarget = EngineRetarget(("http://e:8000",), EXPORT, current.get, lambda i, d: i in stale, read=lambda url, timeout: EngineList(tuple(cards)), unload=unload)
    return retarget, unloaded


def test_after_a_move_every_card_of_the_id_but_the_new_digests_is_unloaded() -> None:
    cards = [EngineLoRA("team-a/x", f"{EXPORT}/{version_name('team-a/x', OLD)}"), EngineLoRA("team-a/y", f"{EXPORT}/{version_name('team-a/y', OLD)}")]
    retarget, unloaded = _retarget(cards, {"team-a/x": NEW, "team-a/y": OLD}, set())
    retarget.on_move("team-a/x", OLD, NEW)
    assert unloaded == [("http://e:8000", "team-a/x")]
    retarget.on_move("team-a/x", OLD, NEW)  # the engine still lists it (the fake does): asked again, never another id
    assert {name for _, name in unloaded} == {"team-a/x"}


def test_a_round_unloads_cards_of_a_digest_their_id_left_and_names_the_stale_origin_ids() -> None:
    cards = [
        EngineLoRA("team-a/x", f"{EXPORT}/{version_name('team-a/x', OLD)}"),  # its id moved on: unloaded
        EngineLoRA("team-a/y", f"{EXPORT}/{version_name('team-a/y', NEW)}"),  # current, and due a revalidation
        EngineLoRA("team-a/z", "/opt/loras/z"),  # loaded from elsewhere by name: its id is revalidated, never unloaded here
        EngineLoRA("not an id", "/opt/x"),
    ]
    retarget, unloaded = _retarget(cards, {"team-a/x": NEW, "team-a/y": NEW, "team-a/z": OLD}, {"team-a/y", "team-a/z"})
    assert retarget.sweep() == ["team-a/y", "team-a/z"]
    assert unloaded == [("http://e:8000", "team-a/x")]


async def test_a_round_that_fails_leaves_the_watch_running() -> None:
    """A store that cannot be read (``current`` raising, as a vanished store's ref read does) or a revalidation that
    fails on the disk is logged, and the next round runs: the watch is the only thing that keeps engines off moved ids."""
    import asyncio

    from adapter_fabric.errors import StoreMissing

    cards = [EngineLoRA("team-a/y", f"{EXPORT}/{version_name('team-a/y', NEW)}")]
    reads: list[str] = []
    revalidated: list[str] = []

    def current(adapter_id: str) -> str | None:
        reads.append(adapter_id)
        if len(reads) == 1:
            raise StoreMissing("the store at /srv/store is gone")
        return NEW

    async def io(call, *args):
        return call(*args)

    async def revalidate(adapter_id: str) -> None:
        revalidated.append(adapter_id)
        raise OSError(28, "No space left on device")

    retarget = EngineRetarget(("http://e:8000",), EXPORT, current, lambda i, d: True, interval=0.01, read=lambda url, timeout: EngineList(tuple(cards)))
    watch = asyncio.create_task(retarget.watch(io, revalidate))
    try:
        for _ in range(200):
            if len(revalidated) >= 2:
                break
            await asyncio.sleep(0.01)
        assert len(reads) >= 3 and revalidated[:2] == ["team-a/y", "team-a/y"] and not watch.done()
    finally:
        watch.cancel()
