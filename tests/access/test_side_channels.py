"""Issue 28 (7): no tenant learns another's ids, usage or holdings, with a real policy node.

Team-a's adapter is resident in a slot and staged; team-b may read and publish
under ``team-b/`` only. The unauthenticated ``/metrics`` names no adapter id
(unless the operator opts in, ``--metrics-adapter-labels``); team-b's StoreStatus
shows its own quota line, not team-a's; and a Stage of bytes team-a holds tells
team-b nothing (``already_staged`` false), while it still tells a tenant about
bytes it may read. An eviction team-b sees in StoreStatus names its own id, not team-a's commit it made room for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from adapter_fabric.access.policy import token_sha256
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from tests.support.scrape import http_get, scrape

pytestmark = pytest.mark.slow

TOKENS = {"cluster": "cluster-token-a41f", "team-a": "team-a-token-7c02", "team-b": "team-b-token-e9d3", "peers": "peers-token-5b18"}
SECRET = "team-a/secret-launch-v7"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root, base = tmp_path_factory.mktemp("adapters"), build_tiny_model()
    return {name: make_peft_adapter(root / name, base_model=base, r=4, seed=i) for i, name in enumerate(("secret", "b"))}


@pytest.fixture(scope="module")
def node(tmp_path_factory, adapters):
    root = tmp_path_factory.mktemp("side")
    (root / "cluster.token").write_text(TOKENS["cluster"])
    (root / "peer.token").write_text(TOKENS["peers"])  # what a node sends its members (the eviction test's second node)
    (root / "policy.toml").write_text(f"""
[[principal]]
name = "team-a"
token_sha256 = "{token_sha256(TOKENS['team-a'])}"
grants = [{{ verbs = ["read", "pull", "publish", "operate"], prefixes = ["team-a/"] }}]

[[principal]]
name = "team-b"
token_sha256 = "{token_sha256(TOKENS['team-b'])}"
grants = [{{ verbs = ["read", "publish"], prefixes = ["team-b/"] }}, {{ verbs = ["read"], prefixes = ["team-a/public/"] }}]

[[principal]]
name = "peers"
token_sha256 = "{token_sha256(TOKENS['peers'])}"
grants = [{{ verbs = ["read", "pull"], prefixes = ["*"] }}]

[[quota]]
prefix = "team-a/"
max_bytes = "1GiB"

[[quota]]
prefix = "team-b/"
max_adapters = 10
""")
    with LocalNode(root / "store", token_file=root / "cluster.token", extra_args=["--policy", str(root / "policy.toml"), "--metrics-listen", "127.0.0.1:0"]) as n:
        with as_(n, "team-a") as team_a:
            team_a.stage(adapters["secret"], SECRET)
            team_a.promote(SECRET)  # resident in a slot, named by its id
        yield n


def as_(node: LocalNode, who: str) -> NodeClient:
    return NodeClient(node.address, token=TOKENS[who], timeout=60)


def test_metrics_name_no_adapter_unless_the_operator_opts_in(node) -> None:
    status, text = http_get(node.metrics_address, "/metrics")
    assert status == 200 and "secret-launch" not in text and "team-a" not in text
    resident = [dict(labels) for (name, labels), value in scrape(node).items() if name == "fabric_resident_adapter_info" and value == 1]
    assert len(resident) == 1 and resident[0]["adapter"] == "" and resident[0]["content_id"]  # the slot and content id remain


def test_store_status_shows_only_the_quota_lines_the_caller_may_read(node) -> None:
    with as_(node, "team-b") as team_b:
        assert [t.prefix for t in team_b.store_status().tenants] == ["team-b/"]  # read on team-a/public/ is not all of team-a/
    with as_(node, "team-a") as team_a:
        [line] = team_a.store_status().tenants
        assert line.prefix == "team-a/" and line.adapters == 1 and line.bytes > 0
    with node.client() as admin:
        assert [t.prefix for t in admin.store_status().tenants] == ["team-a/", "team-b/"]


def test_already_staged_tells_only_about_bytes_the_caller_may_read(node, adapters) -> None:
    with as_(node, "team-b") as team_b:
        assert team_b.stage(adapters["secret"], "team-b/copy").already_staged is False  # team-a's holdings: not team-b's to learn
        assert team_b.stage(adapters["secret"], "team-b/copy-2").already_staged is True  # it may read team-b/copy
        assert team_b.stage(adapters["b"], "team-b/own").already_staged is False
        assert team_b.stage(adapters["b"], "team-b/own").already_staged is True  # the same id again
    with as_(node, "team-a") as team_a:
        assert team_a.stage(adapters["secret"], SECRET).already_staged is True


def test_an_eviction_shows_a_tenant_its_ids_and_not_the_commit_of_another_tenant_it_made_room_for(node, adapters, tmp_path) -> None:
    """StoreStatus lists the latest evictions (issue 33) with the commit each made room for: another tenant's id, which
    only a caller who may read every id sees."""
    newer = make_peft_adapter(tmp_path / "newer", base_model=build_tiny_model(), r=4, seed=2)  # the same shape: the same size
    with node.client() as admin:
        size = next(a.size for a in admin.list().staged if a.adapter_id == SECRET)
        admin.stage(adapters["b"], "team-b/elsewhere")  # a copy on a peer: team-b's adapter is not a last copy, so it may go
    root = node.store.parent  # the module node's token and policy files
    flags = ["--policy", str(root / "policy.toml"), "--peer-token-file", str(root / "peer.token"), "--max-store-bytes", str(size * 5 // 2)]
    with LocalNode(tmp_path / "S", token_file=root / "cluster.token", peers=[node.address], extra_args=flags) as evicting:
        with as_(evicting, "team-b") as team_b, as_(evicting, "team-a") as team_a:
            team_b.stage(adapters["b"], "team-b/cold")
            team_a.stage(adapters["secret"], "team-a/warm")
            team_a.stage(newer, SECRET)  # two fit, not three: team-b/cold, the least recently used, goes
            (seen_by_b,) = team_b.store_status().recent_evictions
            assert seen_by_b.adapter_ids == ["team-b/cold"] and seen_by_b.reason == "", seen_by_b
            assert team_a.store_status().recent_evictions == []  # nothing of team-a's went
        with evicting.client() as admin:
            (seen,) = admin.store_status().recent_evictions
            assert seen.adapter_ids == ["team-b/cold"] and SECRET in seen.reason, seen
