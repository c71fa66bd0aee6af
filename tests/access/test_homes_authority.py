"""Issues 28 and 32 together: a pull naming no peer goes through the id's homes (placement, on by default) under
``--policy``, with five real node processes, and every call it makes to a member names the caller.

- team-a, which may pull ``team-a/``, pulls without ``--from``: the homes name the holders, the bytes come from them;
- team-c, granted nothing under ``team-a/``, is refused by name at the node it asks, and no byte moves anywhere;
- authority travels: the pulling node's policy was widened for team-b (as while a new policy reaches one node first),
  the holders' was not. The lookups at the homes (``Locate``, ``read``) and the pull's calls name team-b
  (``fabric-on-behalf-of``), so each holder admits only what both the node's peer principal and team-b may there: the
  homes refuse, nothing is found, no byte moves. Were the caller not forwarded, the homes would answer the peer
  principal (which may read and pull everything) and the bytes would move.

The nodes call each other with the peer principal's token (``FABRIC_PEER_TOKEN_FILE``); a client's token is its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from adapter_fabric.access.policy import token_sha256
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.errors import AdapterNotFound, PermissionDenied
from adapter_fabric.harness.cluster import LocalNode, free_port, running
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.transport.placement import Fleet

from tests.node.test_homes import held
from tests.support.scrape import scrape
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NODES = 5
K = 3  # --homes' default
TOKENS = {"cluster": "cluster-token-5a0e", "peers": "peer-token-d2c4", "team-a": "team-a-token-17f3", "team-b": "team-b-token-88ba", "team-c": "team-c-token-3e90"}


def policy_text(team_b_prefixes: list[str]) -> str:
    def principal(name: str, grants: str) -> str:
        return f'[[principal]]\nname = "{name}"\ntoken_sha256 = "{token_sha256(TOKENS[name])}"\ngrants = [{grants}]\n'

    return "\n".join((
        principal("peers", '{ verbs = ["read", "pull", "operate"], prefixes = ["*"] }'),
        principal("team-a", '{ verbs = ["read", "pull", "operate", "publish"], prefixes = ["team-a/"] }'),
        principal("team-b", f'{{ verbs = ["read", "pull", "operate", "publish"], prefixes = {team_b_prefixes!r} }}'.replace("'", '"')),
        principal("team-c", '{ verbs = ["read", "pull", "operate", "publish"], prefixes = ["team-c/"] }'),
    ))  # fmt: skip


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Five nodes, each listing the others (``--peers``), placement at its default; node 1 is the one whose policy also
    grants team-b ``team-a/``."""
    root = tmp_path_factory.mktemp("homes-authority")
    for who, token in TOKENS.items():
        (root / f"{who}.token").write_text(token + "\n")
    (root / "policy.toml").write_text(policy_text(["team-b/"]))
    (root / "widened.toml").write_text(policy_text(["team-b/", "team-a/"]))
    ports = [free_port() for _ in range(NODES)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    nodes = [
        LocalNode(
            root / f"n{i}", model="none", port=port, peers=[a for a in addresses if a != addresses[i]], token_file=root / "cluster.token",
            extra_args=["--policy", str(root / ("widened.toml" if i == 1 else "policy.toml")), "--metrics-listen", "127.0.0.1:0"],
            env={"FABRIC_PEER_TOKEN_FILE": str(root / "peers.token")},
        )  # fmt: skip
        for i, port in enumerate(ports)
    ]
    with running(nodes):
        yield nodes


def as_principal(node: LocalNode, who: str) -> NodeClient:
    return NodeClient(node.address, token=TOKENS[who], timeout=120)


def counter(nodes: list[LocalNode], name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for n in nodes for (metric, have), v in scrape(n).items() if metric == name and want <= have)


def published(fleet: list[LocalNode], name: str, seed: int, tmp_path: Path) -> tuple[str, list[str]]:
    """A fresh adapter (bytes no node holds under another id) staged by the cluster principal on node 0, under a
    ``team-a/`` id none of whose homes is node 0 or node 1 (so the bytes must travel to node 1); once its homes hold it:
    the id and its homes."""
    fleet_view = Fleet.of(n.address for n in fleet)
    avoid = {fleet[0].address, fleet[1].address}
    adapter_id = next(f"team-a/{name}-{i}" for i in range(1000) if not avoid & set(fleet_view.homes(f"team-a/{name}-{i}", K)))
    homes = fleet_view.homes(adapter_id, K)
    adapter = make_peft_adapter(tmp_path / name, base_model=build_tiny_model(), seed=seed, r=4)
    with fleet[0].client() as admin:
        admin.stage(adapter, adapter_id)
    by_address = {n.address: n for n in fleet}
    wait_for(lambda: all(adapter_id in held(by_address[h]) for h in homes), what=f"the homes of {adapter_id} to hold it")
    return adapter_id, homes


def test_a_team_pulls_through_its_homes_without_naming_a_peer(fleet, tmp_path) -> None:
    adapter_id, homes = published(fleet, "through-homes", 41, tmp_path)
    asked = counter([fleet[1]], "fabric_lookup_calls_total", kind="home")
    with as_principal(fleet[1], "team-a") as team_a:
        reply = team_a.pull(adapter_id)  # no --from: node 1 asks the id's homes, as team-a
    # from the holders the homes named: the homes, and the publisher (it told them it holds a copy)
    assert reply.bytes_transferred > 0 and set(reply.source_peer.split(",")) <= {*homes, fleet[0].address}, reply.source_peer
    assert counter([fleet[1]], "fabric_lookup_calls_total", kind="home") > asked
    assert adapter_id in held(fleet[1])


def test_a_principal_without_the_grant_is_refused_by_name_and_moves_no_bytes(fleet, tmp_path) -> None:
    adapter_id, _ = published(fleet, "not-yours", 42, tmp_path)
    served = counter(fleet, "fabric_served_bytes_total")
    with as_principal(fleet[1], "team-c") as team_c, pytest.raises(PermissionDenied) as refused:
        team_c.pull(adapter_id)
    assert "team-c" in str(refused.value) and "operate" in str(refused.value), refused.value
    assert counter(fleet, "fabric_served_bytes_total") == served
    assert adapter_id not in held(fleet[1])


def test_the_holders_admit_only_what_the_caller_may_there_authority_travels_with_the_lookup(fleet, tmp_path) -> None:
    adapter_id, homes = published(fleet, "widened", 43, tmp_path)
    home_nodes = [n for n in fleet if n.address in homes]
    served = counter(fleet, "fabric_served_bytes_total")
    refused_reads = counter(home_nodes, "fabric_access_refusals_total", verb="read")
    with as_principal(fleet[1], "team-b") as team_b, pytest.raises(AdapterNotFound) as missing:
        team_b.pull(adapter_id)  # node 1's own policy lets team-b pull team-a/; the holders' does not
    assert all(h in str(missing.value) for h in homes), missing.value  # the homes were asked, and showed team-b nothing
    assert counter(home_nodes, "fabric_access_refusals_total", verb="read") >= refused_reads + len(homes)  # each home refused team-b's Locate
    assert counter(fleet, "fabric_served_bytes_total") == served
    assert adapter_id not in held(fleet[1])
    with as_principal(fleet[1], "team-a") as team_a:  # the same lookup for a caller the holders admit finds it
        assert team_a.pull(adapter_id).bytes_transferred > 0
