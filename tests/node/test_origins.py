"""Adapters from their origins, through real node processes and real servers: nginx (HTTP, ETags), moto's S3 server,
and a Hub endpoint read by the node's huggingface_hub client (the public Hub is not reachable here).

A miss is fetched once per node (concurrent requests join), lands with the digest staging the same directory gives,
and is served to peers; a changed origin moves the id after the TTL; a pin keeps its bytes; malformed, oversized and
slow content is refused by name with nothing staged; an origin that stops leaves held ids served.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from adapter_fabric.errors import AdapterNotFound, InvalidHeader, LimitExceeded, OriginTooSlow, OriginUnavailable, Untrusted
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.store import AdapterStore
from tests.support import origin_servers as servers
from tests.support.scrape import scrape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
FILES = ("adapter_config.json", "adapter_model.safetensors")


def _put(root: Path, adapter_id: str, source: Path) -> None:
    dest = root / adapter_id
    dest.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        shutil.copyfile(source / name, dest / name)


def _staged_digest(tmp: Path, source: Path) -> str:
    """The digest staging ``source`` gives (the node's default chunk size)."""
    return AdapterStore(tmp / f"ref-{source.name}").stage(source, "ref/x").digest


def _node(tmp: Path, name: str, *args: str, peers: tuple[str, ...] = (), env: dict | None = None) -> LocalNode:
    return LocalNode(tmp / name, model="none", port=free_port(), peers=peers, extra_args=["--metrics-listen", "127.0.0.1:0", *args], env=env).start()


def _fetches(node: LocalNode, origin: str, outcome: str = "ok") -> float:
    return scrape(node).get(("fabric_origin_fetches_total", frozenset({("origin", origin), ("outcome", outcome)})), 0.0)


@pytest.fixture(scope="module")
def web(tmp_path_factory: pytest.TempPathFactory, store_adapters):
    root = tmp_path_factory.mktemp("www")
    _put(root, "team-a/web", store_adapters["a"])
    _put(root, "team-a/moves", store_adapters["a"])
    _put(root, "team-a/bad", store_adapters["corrupt_header"])
    with servers.nginx(root, tmp_path_factory.mktemp("nginx")) as url:
        yield url, root


def test_a_miss_is_fetched_once_per_node_with_the_staged_digest_and_served_to_peers(web, store_adapters, tmp_path: Path) -> None:
    url, root = web
    a = _node(tmp_path, "a", "--origin", url)
    b = _node(tmp_path, "b", "--origin", url, peers=(a.address,))
    try:
        with ThreadPoolExecutor(6) as pool, a.client() as client:
            replies = list(pool.map(lambda _: client.pull("team-a/web"), range(6)))
        digests = {r.digest for r in replies}
        assert digests == {_staged_digest(tmp_path, store_adapters["a"])}  # what staging the same directory gives
        assert _fetches(a, url) == 1  # six concurrent requests joined one origin fetch
        assert all(r.origin == url and r.revision for r in replies)
        with b.client() as client:
            reply = client.pull("team-a/web")  # the fabric first: a peer holds it
        assert reply.digest in digests and reply.source_peers == [a.address] and _fetches(b, url) == 0
        with a.client() as client:
            listed = {s.adapter_id: s for s in client.list().staged}
        assert listed["team-a/web"].origin == url and listed["team-a/web"].revision == replies[0].revision
    finally:
        b.stop()
        a.stop()


def test_a_changed_origin_moves_the_id_after_the_ttl_and_a_pin_keeps_its_bytes(web, store_adapters, tmp_path: Path) -> None:
    url, root = web
    following = _node(tmp_path, "ttl0", "--origin", url, "--origin-ttl", "0")  # every request revalidates
    patient = _node(tmp_path, "ttl1h", "--origin", url, "--origin-ttl", "1h")
    try:
        with following.client() as f, patient.client() as p:
            first = f.pull("team-a/moves")
            assert p.pull("team-a/moves").digest == first.digest
            pinned = f.pull(f"team-a/moves@{first.revision}")
            assert pinned.digest == first.digest
            assert f.pull("team-a/moves").digest == first.digest  # revalidated: a 304, nothing moved
            weights = root / "team-a/moves" / FILES[1]
            weights.unlink()
            _put(root, "team-a/moves", store_adapters["b"])  # the customer retrained: new bytes, a new ETag
            moved = f.pull("team-a/moves")
            assert moved.digest == _staged_digest(tmp_path, store_adapters["b"]) != first.digest
            assert moved.revision != first.revision and f.manifest("team-a/moves").digest == moved.digest  # the old digest is not served under the id
            assert p.pull("team-a/moves").digest == first.digest  # within its TTL: not asked again
            assert f.pull(f"team-a/moves@{first.revision}").digest == first.digest  # a pin never moves
            with pytest.raises(AdapterNotFound, match="no longer has revision"):
                f.pull("team-a/moves@5f00dead-3c08")  # a revision the origin does not have (If-Match: 412)
        revalidations = scrape(following)
        assert revalidations[("fabric_origin_revalidations_total", frozenset({("origin", url), ("result", "changed")}))] == 1
        assert revalidations[("fabric_origin_revalidations_total", frozenset({("origin", url), ("result", "unchanged")}))] >= 1
    finally:
        patient.stop()
        following.stop()


def test_malformed_oversized_and_slow_content_is_refused_by_name_with_nothing_staged(web, tmp_path: Path) -> None:
    url, _ = web
    plain = _node(tmp_path, "plain", "--origin", url)
    small = _node(tmp_path, "small", "--origin", url, "--max-adapter-bytes", "4KiB")
    slow = _node(tmp_path, "slow", "--origin", f"{url}/slow#timeout=2s")
    try:
        for node, adapter_id, error, words in (
            (plain, "team-a/bad", InvalidHeader, f"origin {url}: team-a/bad: refused, nothing staged"),
            (small, "team-a/web", LimitExceeded, "more than this node accepts"),
            (slow, "team-a/web", OriginTooSlow, "slow or stalled"),
        ):
            with node.client() as client:
                with pytest.raises(error, match=words):
                    client.pull(adapter_id)
                assert client.list().staged == [] and client.store_status().adapters == 0
        assert scrape(slow)[("fabric_origin_errors_total", frozenset({("origin", f"{url}/slow"), ("kind", "OriginTooSlow")}))] == 1
    finally:
        for node in (slow, small, plain):
            node.stop()


def test_an_origin_that_stops_leaves_held_ids_served_and_names_itself_in_a_miss(store_adapters, tmp_path: Path) -> None:
    root = tmp_path / "www"
    _put(root, "team-a/held", store_adapters["a"])
    with servers.nginx(root, tmp_path / "nginx") as url:
        node = _node(tmp_path, "n", "--origin", url, "--origin-ttl", "0")
        with node.client() as client:
            held = client.pull("team-a/held")
    try:
        with node.client() as client:  # nginx is gone
            assert client.pull("team-a/held").digest == held.digest  # revalidation failed: the held digest is served on
            with pytest.raises(OriginUnavailable, match=f"origin {url}: team-a/absent: adapter_config.json could not be fetched"):
                client.pull("team-a/absent")
            status = client.store_status()
        assert [(o.origin, o.answering) for o in status.origins] == [(url, False)] and "could not be fetched" in status.origins[0].error
    finally:
        node.stop()


def test_a_trusting_node_takes_origin_content_only_from_an_origin_marked_trusted(web, tmp_path: Path) -> None:
    from adapter_fabric.trust.signing import keygen

    url, _ = web
    _, public = keygen()
    key = tmp_path / "signer.pub"
    key.write_bytes(public)
    strict = _node(tmp_path, "strict", "--origin", url, "--trusted-signers", str(key))
    vouching = _node(tmp_path, "vouching", "--origin", f"{url}#trusted", "--trusted-signers", str(key))
    try:
        with strict.client() as client, pytest.raises(Untrusted, match="not marked #trusted"):
            client.pull("team-a/web")
        with vouching.client() as client:
            assert client.pull("team-a/web").origin == url
            assert client.manifest("team-a/web").adapter_id == "team-a/web"  # served: vouched for by the operator
    finally:
        vouching.stop()
        strict.stop()


def test_s3_and_the_hub_through_node_processes(store_adapters, tmp_path: Path) -> None:
    with servers.moto_s3() as endpoint, servers.hub_endpoint(tmp_path / "hub", token="hf_node_token") as (hub_url, repos):
        client = servers.s3_client(endpoint)
        client.create_bucket(Bucket="adapters")
        servers.put_adapter_s3(client, "adapters", "prod/team-a/s3", store_adapters["a"])
        repos.publish("team-a/hub", store_adapters["b"])
        # The standard variables, as an operator sets them: AWS_ENDPOINT_URL, credentials, HF_ENDPOINT, HF_TOKEN.
        env = {**servers.S3_ENV, "AWS_ENDPOINT_URL": endpoint, "HF_ENDPOINT": hub_url, "HF_TOKEN": "hf_node_token"}
        node = _node(tmp_path, "n", "--origin", "s3://adapters/prod", "--origin", "hf://", env=env)
        try:
            with node.client() as c:
                from_s3 = c.pull("team-a/s3")
                from_hub = c.pull("team-a/hub")
            assert from_s3.digest == _staged_digest(tmp_path, store_adapters["a"]) and from_s3.origin == "s3://adapters/prod"
            assert from_hub.digest == _staged_digest(tmp_path, store_adapters["b"]) and from_hub.origin == "hf://"
            assert from_hub.revision == repos.commit("team-a/hub", "main")
            assert _fetches(node, "s3://adapters/prod", "AdapterNotFound") == 1  # asked first for the Hub's id, in order
            assert "hf_node_token" not in (tmp_path / "n.log").read_text()
        finally:
            node.stop()


def test_a_caller_without_pull_on_the_id_gets_nothing_from_an_origin(web, tmp_path: Path) -> None:
    """Invariant 18: the node brings bytes for a caller only on the caller's own grants, wherever they come from."""
    from adapter_fabric.access.policy import token_sha256
    from adapter_fabric.errors import PermissionDenied

    url, _ = web
    tokens = {"operator": "operator-token-1f2e", "puller": "puller-token-9a8b"}
    grants = {"operator": '["read", "operate"]', "puller": '["read", "operate", "pull"]'}
    policy = tmp_path / "policy.toml"
    policy.write_text("".join(
        f'[[principal]]\nname = "{n}"\ntoken_sha256 = "{token_sha256(t)}"\ngrants = [{{ verbs = {grants[n]}, prefixes = ["team-a/"] }}]\n\n'
        for n, t in tokens.items()
    ))  # fmt: skip
    node = _node(tmp_path, "n", "--origin", url, "--policy", str(policy))
    try:
        with node.client(token=tokens["operator"]) as client, pytest.raises(PermissionDenied, match="pull"):
            client.pull("team-a/web")
        assert not any(name == "fabric_origin_fetches_total" for name, _ in scrape(node))  # the origin was never asked
        with node.client(token=tokens["puller"]) as client:
            assert client.pull("team-a/web").origin == url
    finally:
        node.stop()
