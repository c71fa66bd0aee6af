"""Issue 28 (1): a node's credential never leaves for an address a caller chose, with real node processes.

A principal with ``operate`` on its own prefix asks a policy node to pull from a
server the test runs (``tests.support.recorder.HeaderRecorder``: it records every
header it receives). The node's peer token reaches members only (``--peers``),
never its cluster token; a caller-named address that is not a member is refused
before anything is dialled, or, where the operator allows it
(``--non-member-peers anonymous``), dialled with no credential at all.

The new settings are given as environment variables (``FABRIC_PEER_TOKEN_FILE``,
``FABRIC_NON_MEMBER_PEERS``), so that a node without them still starts and the
tests fail on what it sends, not on a flag it does not know.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from adapter_fabric.access.policy import token_sha256
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.errors import FabricError, NotAMember, PermissionDenied
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.rpc import security
from adapter_fabric.rpc.security import AUTH_METADATA_KEY, ON_BEHALF_OF_KEY
from adapter_fabric.rpc.status import error_from_rpc
from adapter_fabric.store.manifest import manifest_request
from adapter_fabric.v1 import fabric_pb2_grpc
from tests.node.test_startup import one_line_failure, run_node, store_only
from tests.support.recorder import HeaderRecorder

pytestmark = pytest.mark.slow

TOKENS = {"cluster": "cluster-token-6d0e", "team-a": "team-a-token-2b97", "peers": "peer-token-81c4", "ops": "ops-token-5a10"}


def policy_text() -> str:
    return f"""
[[principal]]
name = "team-a"
token_sha256 = "{token_sha256(TOKENS['team-a'])}"
grants = [{{ verbs = ["read", "pull", "publish", "operate"], prefixes = ["team-a/"] }}]

[[principal]]
name = "peers"
token_sha256 = "{token_sha256(TOKENS['peers'])}"
grants = [{{ verbs = ["read", "pull"], prefixes = ["*"] }}]

[[principal]]
name = "ops"
token_sha256 = "{token_sha256(TOKENS['ops'])}"
grants = [{{ verbs = ["admin"], prefixes = ["*"] }}]
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("credentials")
    found = {"policy": root / "policy.toml"}
    found["policy"].write_text(policy_text())
    for who, token in TOKENS.items():
        found[who] = root / f"{who}.token"
        found[who].write_text(token + "\n")
    return found


@pytest.fixture(scope="module")
def member():
    with HeaderRecorder() as server:
        yield server


def policy_node(root: Path, files: dict[str, Path], *, peers: tuple[str, ...] = (), env: dict[str, str] | None = None) -> LocalNode:
    return LocalNode(
        root, model="none", peers=peers, token_file=files["cluster"], extra_args=["--policy", str(files["policy"])],
        env={"FABRIC_PEER_TOKEN_FILE": str(files["peers"]), **(env or {})},
    )


@pytest.fixture(scope="module")
def node(tmp_path_factory, files, member):
    """A policy node whose one member is the recording server; it refuses to dial non-members (the default)."""
    with policy_node(tmp_path_factory.mktemp("node") / "store", files, peers=(member.address,)) as n:
        yield n


def team_a(node: LocalNode) -> NodeClient:
    return NodeClient(node.address, token=TOKENS["team-a"], timeout=30)


def sent_tokens(server: HeaderRecorder) -> list[str]:
    return server.headers(AUTH_METADATA_KEY)


def test_a_caller_named_server_is_refused_by_name_and_never_dialled(node, files) -> None:
    with HeaderRecorder() as stranger, team_a(node) as c:
        with pytest.raises(NotAMember) as refused:
            c.pull("team-a/x", peer=stranger.address)
        with pytest.raises(NotAMember):
            c.pull("team-a/x", peer=stranger.address, named_peer_only=True)
    assert f"peer '{stranger.address}' is not a member" in str(refused.value)
    assert stranger.calls == []  # nothing dialled: no token, no other header, no connection reached a handler


def test_members_get_the_peer_token_and_the_caller_never_the_cluster_token(node, member) -> None:
    before = len(member.calls)
    with team_a(node) as c:
        with pytest.raises(FabricError):  # the recorder answers UNIMPLEMENTED: nothing to pull, but it saw the headers
            c.pull("team-a/x", peer=member.address)
    calls = member.calls[before:]
    assert calls and all(metadata.get(AUTH_METADATA_KEY) == f"Bearer {TOKENS['peers']}" for _, metadata in calls), calls
    assert all(metadata.get(ON_BEHALF_OF_KEY) == "sha256:" + token_sha256(TOKENS["team-a"]) for _, metadata in calls), calls
    assert not any(TOKENS["cluster"] in value for _, metadata in member.calls for value in metadata.values())


def test_an_operator_may_allow_anonymous_pulls_from_non_members(tmp_path, files) -> None:
    with HeaderRecorder() as stranger:
        with policy_node(tmp_path / "anon", files, env={"FABRIC_NON_MEMBER_PEERS": "anonymous"}) as n, team_a(n) as c:
            with pytest.raises(FabricError) as failed:
                c.pull("team-a/x", peer=stranger.address)
            assert not isinstance(failed.value, NotAMember)
        assert stranger.calls, "the anonymous pull dialled the named server"
        assert sent_tokens(stranger) == [] and stranger.headers(ON_BEHALF_OF_KEY) == []


def test_a_policy_node_refuses_to_start_with_its_cluster_token_as_peer_token(tmp_path, files) -> None:
    args = store_only(tmp_path, "--policy", str(files["policy"]), "--auth-token-file", str(files["cluster"]))
    one_line_failure(run_node([*args, "--peer-token-file", str(files["cluster"])]), "--peer-token-file", "same token as --auth-token-file")
    one_line_failure(run_node([*args, "--peer-token-file", str(files["ops"])]), "--peer-token-file", "'ops'", "admin")
    empty = tmp_path / "empty.token"
    empty.write_text("\n")
    one_line_failure(run_node([*args, "--peer-token-file", str(empty)]), "--peer-token-file", "empty")
    assert not (tmp_path / "store").exists()  # refused before the store is opened


def test_a_node_without_a_policy_refuses_a_token_guarded_call_made_for_another_principal(tmp_path, files) -> None:
    """It cannot tell what that principal may do; its token would grant everything. Open peer reads stay open to anyone."""
    behalf = ((ON_BEHALF_OF_KEY, "sha256:" + token_sha256(TOKENS["team-a"])),)
    with LocalNode(tmp_path / "guarded", model="none", token_file=files["peers"], extra_args=["--auth-peer-reads"]) as guarded:
        stub = fabric_pb2_grpc.FabricStub(security.channel(guarded.address, token=TOKENS["peers"]))
        with pytest.raises(grpc.RpcError) as refused:
            stub.GetManifest(manifest_request("team-a/x"), metadata=behalf, timeout=10)
        error = error_from_rpc(refused.value)
        assert isinstance(error, PermissionDenied) and "no --policy" in str(error)
        with pytest.raises(grpc.RpcError) as missing:  # without the name, the same call passes the token check
            stub.GetManifest(manifest_request("team-a/x"), timeout=10)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
