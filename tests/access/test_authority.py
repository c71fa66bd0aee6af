"""Issue 28 (2, 3): a pull on someone's behalf gives them nothing they could not take themselves, with real node processes.

Two policy nodes; node 1 holds ``shared/cat``, which team-a may read (GetManifest)
but not pull. Team-a serves that manifest under its own id from a server of its
own (``Borrower``, which has none of the bytes) and asks a node to pull it from
there. The node holding the bytes must not record team-a's id for them without
moving them (same node); a node holding nothing must not fetch them from node 1 as
its own peer principal (across two nodes): its calls name team-a
(``fabric-on-behalf-of``) and node 1 admits only what both may do.

The nodes' peer token is given as ``FABRIC_PEER_TOKEN_FILE``: a node without that
setting still starts, and sends its cluster token to its peers instead.
"""

from __future__ import annotations

import re
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from adapter_fabric.access.policy import token_sha256
from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.errors import AdapterNotFound, FabricError, PermissionDenied
from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.rpc import security
from adapter_fabric.rpc.security import ON_BEHALF_OF_KEY
from adapter_fabric.rpc.status import error_from_rpc
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from adapter_fabric.store.manifest import manifest_request
from adapter_fabric.transport import wire
from adapter_fabric.transport.data_channel import DataChannelFailed, DataChannels
from adapter_fabric.transport.fetch_metadata import announce_data_port
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc

pytestmark = pytest.mark.slow

TOKENS = {"cluster": "cluster-token-0c5d", "team-a": "team-a-token-9e21", "peers": "peer-token-47b8"}
TEAM_A = "sha256:" + token_sha256(TOKENS["team-a"])


def policy_text() -> str:
    return f"""
[[principal]]
name = "team-a"
token_sha256 = "{token_sha256(TOKENS['team-a'])}"
grants = [{{ verbs = ["read", "pull", "publish", "operate"], prefixes = ["team-a/"] }}, {{ verbs = ["read"], prefixes = ["shared/"] }}]

[[principal]]
name = "peers"
token_sha256 = "{token_sha256(TOKENS['peers'])}"
grants = [{{ verbs = ["read", "pull"], prefixes = ["*"] }}]
"""


class Borrower(fabric_pb2_grpc.FabricServicer):
    """Team-a's own server: it answers GetManifest with a manifest it only read, says it holds every chunk, and sends none."""

    def __init__(self) -> None:
        self.manifest: fabric_pb2.Manifest | None = None
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=wire.SERVER_OPTIONS)
        wire.add_fabric_servicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    def GetManifest(self, request, context):
        if self.manifest is None or request.adapter_id != self.manifest.adapter_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"{request.adapter_id} is not here")
        return self.manifest

    def Availability(self, request, context):
        count = self.manifest.files[-1].chunk_count if self.manifest is not None else 0
        return fabric_pb2.AvailabilityResponse(complete=True, chunk_count=count)

    def Fetch(self, request, context):
        context.abort(grpc.StatusCode.NOT_FOUND, "the borrower holds none of the bytes")
        yield b""


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, Path]:
    root, base = tmp_path_factory.mktemp("adapters"), build_tiny_model()
    return {name: make_peft_adapter(root / name, base_model=base, r=4, seed=i) for i, name in enumerate(("cat", "own"))}


@pytest.fixture(scope="module")
def world(tmp_path_factory, adapters):
    root = tmp_path_factory.mktemp("authority")
    (root / "policy.toml").write_text(policy_text())
    for who, token in TOKENS.items():
        (root / f"{who}.token").write_text(token + "\n")
    borrower = Borrower()
    borrower.server.start()
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    nodes = [
        LocalNode(
            root / f"n{i + 1}", model="none", port=ports[i], peers=[addresses[1 - i], borrower.address], token_file=root / "cluster.token",
            extra_args=["--policy", str(root / "policy.toml"), "--chunk-size", "4096", "--stall-timeout", "3"], env={"FABRIC_PEER_TOKEN_FILE": str(root / "peers.token")},
        )
        for i in range(2)
    ]
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_ready()
        with nodes[0].client() as admin:  # the cluster token
            admin.stage(adapters["cat"], "shared/cat")
        with as_team_a(nodes[0]) as team_a:
            borrowed = team_a.manifest_proto("shared/cat")  # read: allowed
        borrowed.adapter_id = "team-a/cat"
        borrower.manifest = borrowed
        yield {"n1": nodes[0], "n2": nodes[1], "borrower": borrower, "digest": borrowed.digest}
    finally:
        for node in nodes:
            node.stop()
        borrower.server.stop(None)


def as_team_a(node: LocalNode) -> NodeClient:
    return NodeClient(node.address, token=TOKENS["team-a"], timeout=60)


def weights_size(directory: Path) -> int:
    return (directory / "adapter_model.safetensors").stat().st_size


def fetch_bytes(node: LocalNode, token: str, adapter_id: str = "", digest: str = "", behalf: str = "") -> int:
    stub = fabric_pb2_grpc.FabricStub(security.channel(node.address, token=token))
    metadata = ((ON_BEHALF_OF_KEY, behalf),) if behalf else ()
    try:
        return sum(len(c.data) for c in stub.Fetch(fabric_pb2.FetchRequest(adapter_id=adapter_id, digest=digest), metadata=metadata, timeout=30))
    except grpc.RpcError as exc:
        raise error_from_rpc(exc) from None


def assert_not_staged(node: LocalNode, adapter_id: str) -> None:
    with node.client() as admin:
        with pytest.raises(AdapterNotFound):
            admin.manifest(adapter_id)


def test_read_never_becomes_pull_on_the_node_that_holds_the_bytes(world) -> None:
    n1 = world["n1"]
    with as_team_a(n1) as team_a:
        with pytest.raises(FabricError) as refused:
            team_a.pull("team-a/cat", peer=world["borrower"].address)
        with pytest.raises(AdapterNotFound):
            fetch_bytes(n1, TOKENS["team-a"], adapter_id="team-a/cat")
    assert "stopped at 0 of" in str(refused.value), refused.value  # the bytes had to come from the peers; none sent them
    assert_not_staged(n1, "team-a/cat")
    with pytest.raises(PermissionDenied):
        fetch_bytes(n1, TOKENS["team-a"], digest=world["digest"])  # and the digest is still only shared/cat's


def test_read_never_becomes_pull_across_two_nodes(world) -> None:
    n2 = world["n2"]
    with as_team_a(n2) as team_a:
        with pytest.raises(FabricError):
            team_a.pull("team-a/cat", peer=world["borrower"].address)
    assert_not_staged(n2, "team-a/cat")
    with pytest.raises(AdapterNotFound):  # no byte of shared/cat came over as the peer principal
        fetch_bytes(n2, TOKENS["cluster"], digest=world["digest"])


def test_a_digest_pin_never_turns_held_bytes_into_the_callers(world) -> None:
    """A pull naming no peer, of ``ID@DIGEST`` (issue 31's pins): the digest is shared/cat's, which team-a may read (its
    manifest says the digest) but not pull. Node 1 holds it; it must not put team-a's id on it without the bytes coming
    from somewhere team-a may take them."""
    n1, digest = world["n1"], world["digest"]
    pinned = f"team-a/pinned@{digest}"
    with as_team_a(n1) as team_a:
        with pytest.raises(FabricError):
            team_a.pull(pinned)
        for adapter_id in (pinned, "team-a/pinned"):
            with pytest.raises(AdapterNotFound):
                fetch_bytes(n1, TOKENS["team-a"], adapter_id=adapter_id)
    with n1.client() as admin:
        assert not [a for a in admin.list().staged if a.adapter_id.startswith("team-a/pinned")]


def test_a_delegated_call_is_admitted_only_where_both_principals_may(world) -> None:
    n1, digest = world["n1"], world["digest"]
    peer = TOKENS["peers"]
    assert fetch_bytes(n1, peer, adapter_id="shared/cat") > 0  # the peer principal alone may pull it
    with pytest.raises(PermissionDenied, match=r"team-a \(via peers\)' lacks 'pull'"):
        fetch_bytes(n1, peer, adapter_id="shared/cat", behalf=TEAM_A)
    with pytest.raises(PermissionDenied):
        fetch_bytes(n1, peer, digest=digest, behalf=TEAM_A)
    with pytest.raises(PermissionDenied):  # team-a's token naming the peer principal gains nothing either
        fetch_bytes(n1, TOKENS["team-a"], adapter_id="shared/cat", behalf="sha256:" + token_sha256(peer))
    stub = fabric_pb2_grpc.FabricStub(security.channel(n1.address, token=peer))
    assert stub.GetManifest(manifest_request("shared/cat"), metadata=((ON_BEHALF_OF_KEY, TEAM_A),), timeout=10).digest == digest
    for unknown in ("sha256:" + "0" * 64, "sha256:nothex", "san:nobody.example", "garbage", "x" * 900):
        with pytest.raises(PermissionDenied, match="does not know"):
            fetch_bytes(n1, peer, adapter_id="shared/cat", behalf=unknown)


def test_the_data_channel_hello_names_the_caller_too(world) -> None:
    n1, digest = world["n1"], world["digest"]
    port = int(re.search(r"data channel on port (\d+)", n1.banner).group(1))

    def data_fetch(behalf: str) -> int:
        channels = DataChannels(token=TOKENS["peers"])
        channels.learn(n1.address, announce_data_port(port))
        call = channels.open(n1.address, fabric_pb2.FetchRequest(digest=digest), None, 4096, behalf=behalf)
        try:
            return sum(len(view) for _, view in call)
        except DataChannelFailed as exc:
            raise exc.error from None

    assert data_fetch("") > 0
    with pytest.raises(PermissionDenied, match="lacks 'pull'"):
        data_fetch(TEAM_A)


def test_a_caller_that_holds_the_bytes_proves_it_by_sending_them(world, adapters) -> None:
    n1, n2 = world["n1"], world["n2"]
    with as_team_a(n2) as on_n2:
        on_n2.stage(adapters["cat"], "team-a/mine")  # team-a has the bytes: it may publish them as its own
    with as_team_a(n1) as team_a:
        pulled = team_a.pull("team-a/mine", peer=n2.address)
    assert pulled.digest == world["digest"]
    assert pulled.bytes_transferred == weights_size(adapters["cat"])  # n1 held them, yet they came from n2, each chunk verified
    assert fetch_bytes(n1, TOKENS["team-a"], adapter_id="team-a/mine") == weights_size(adapters["cat"])


def test_a_pull_for_a_caller_takes_what_the_caller_may_pull_at_the_holder(world, adapters) -> None:
    n1, n2 = world["n1"], world["n2"]
    with as_team_a(n1) as team_a:
        staged = team_a.stage(adapters["own"], "team-a/own")
    with as_team_a(n2) as team_a:
        pulled = team_a.pull("team-a/own", peer=n1.address)  # n2 pulls from n1 as its peer principal, for team-a
    assert pulled.digest == staged.digest and pulled.bytes_transferred == weights_size(adapters["own"])
