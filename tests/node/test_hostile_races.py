"""Issue 29, items 8 and 10 (exit statuses): a pull or a Fetch that loses its bytes to an unstage or an eviction is told so
(``AdapterNotFound``), never that its data is damaged; ``promote --from unix:...`` is a usage error; ``locate`` on a node
that knows no peers is a refusal, not "retry".

The races' windows (a blob removed between its lookup and its read; a reference made while another pull's download of
the same digest is under way) are opened by hand here, in that order, on real stores and a real seed node: a swarm of
pulls racing unstages hit them 1-2 times in ~3,500.
"""

from __future__ import annotations

import pytest

from adapter_fabric.cli.main import run as cli
from adapter_fabric.errors import AdapterNotFound, IntegrityError
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.store import AdapterStore
from adapter_fabric.store.manifest import WEIGHTS_FILE
from adapter_fabric.transport.pull import PeerPuller


def test_a_blob_gone_with_its_unstaged_id_is_not_found_not_damage(tmp_path, store_adapters) -> None:
    store = AdapterStore(tmp_path / "store")
    manifest = store.stage(store_adapters["a"], "team/a")  # what a Fetch or a promote looked up a moment ago
    store.unstage("team/a")  # then it went (its blobs with it: nothing else refers to them)
    with pytest.raises(AdapterNotFound, match="was unstaged or evicted meanwhile"):
        store.verified_weights(manifest)  # was: IntegrityError (DATA_LOSS) "... is missing or quarantined"
    store.stage(store_adapters["a"], "team/a")
    store._layout.blob(manifest.weights.root).unlink()  # the id still names the digest: this is damage
    with pytest.raises(IntegrityError, match="missing or quarantined"):
        store.verified_weights(manifest)


@pytest.mark.slow
def test_a_reference_to_bytes_that_left_touches_no_download_under_way(tmp_path, store_adapters) -> None:
    seed = LocalNode(tmp_path / "seed", model="none").start()
    try:
        with seed.client() as client:
            client.stage(store_adapters["a"], "team/a")
        store = AdapterStore(tmp_path / "store")
        puller = PeerPuller(store)
        try:
            manifest, _, _ = puller.manifest([seed.address], "team/a")
            under_way = store.open_partial(manifest)  # another pull's download of the digest, under way
            # A caller joining a download whose commit an unstage undid refers to bytes no longer here:
            with pytest.raises(AdapterNotFound):
                puller._commit_existing(manifest.with_id("team/b"))  # noqa: SLF001 (the joiner's step, in the race's order)
            first = (store_adapters["a"] / WEIGHTS_FILE).read_bytes()[: manifest.weights.chunk_size]
            under_way.write_chunk(0, first)  # was: InvalidArgument "partial download ... was closed or discarded"
            assert 0 in under_way.verified_chunks
            under_way.close()
            assert puller.pull([seed.address], "team/a")[0].digest == manifest.digest  # and that download completes
        finally:
            puller.channels.close()
    finally:
        seed.stop()


def test_promote_from_a_unix_socket_is_a_usage_error(capsys) -> None:
    assert cli(["promote", "127.0.0.1:1", "--id", "team/a", "--from", "unix:/tmp/fabric.sock"]) == 2  # was 1, after dialling the node
    assert "a node reaches its peers at host:port" in capsys.readouterr().err


@pytest.mark.slow
def test_locate_on_a_node_with_no_peers_is_not_found(tmp_path, capsys) -> None:
    node = LocalNode(tmp_path / "n", model="none").start()
    try:
        assert cli(["locate", node.address, "--id", "team/a"]) == 1  # was 3 ("retryable": nothing would change by retrying)
        assert "knows no peers to ask" in capsys.readouterr().err
    finally:
        node.stop()
