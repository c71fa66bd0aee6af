"""Issue 28: a node's credential (token, client certificate) goes only to members of its cluster, never to an address a caller chose.

``Membership`` decides who is a member; ``PeerChannels`` and ``DataChannels`` send
the peer token (and the caller a pull runs for) to members only, which real
servers on loopback record (``tests.support.recorder``).
"""

from __future__ import annotations

import threading

import grpc
import pytest

from adapter_fabric.errors import NotAMember, PermissionDenied
from adapter_fabric.rpc.security import AUTH_METADATA_KEY, ON_BEHALF_OF_KEY
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.data_channel import DataChannels
from adapter_fabric.transport.fetch_metadata import announce_data_port
from adapter_fabric.transport.members import MemberView
from adapter_fabric.transport.membership import REFRESH_S, Membership
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.recorder import HeaderRecorder, HelloRecorder
from tests.support.waiting import wait_for

PEER_TOKEN = "peer-token-3e1f"
CALLER = "sha256:" + "ab" * 32


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_members_are_the_static_peers_and_what_discovery_resolves_now() -> None:
    clock, answers = Clock(), [["10.0.0.5:50051"]]
    resolved: list[int] = []

    def resolve() -> list[str]:
        resolved.append(1)
        return answers[-1]

    members = Membership(("Node1.internal:50051",), resolve, clock=clock)
    assert members.admits("node1.internal:50051")  # as text, case-blind
    assert members.admits("10.0.0.5:50051")
    assert not members.admits("10.0.0.6:50051")
    assert not members.admits("node1.internal:50052")
    answers.append(["10.0.0.6:50051"])
    assert not members.admits("10.0.0.6:50051") and len(resolved) == 1  # a caller cannot make it resolve per call
    clock.now += REFRESH_S
    assert members.admits("10.0.0.6:50051") and not members.admits("10.0.0.5:50051")


def test_a_resolver_failure_keeps_the_last_answer() -> None:
    clock, fail = Clock(), []

    def resolve() -> list[str]:
        if fail:
            raise OSError("no such name")
        return ["10.0.0.5:50051"]

    members = Membership((), resolve, clock=clock)
    assert members.admits("10.0.0.5:50051")
    fail.append(1)
    clock.now += REFRESH_S
    assert members.admits("10.0.0.5:50051")


def test_with_placement_the_fleets_members_are_the_members_one_notion_for_credentials_and_homes() -> None:
    """Issue 32: a node with --homes reads who gets its credential from its MemberView (--peers, --peers-dns and
    --peers-k8s's EndpointSlices, kept current by the node), so every home a lookup asks is credentialed and a member
    that left is not; the view is read at each question (no resolution of its own)."""
    view = MemberView("10.0.0.1:50051", ("10.0.0.2:50051",), is_self=lambda address, listen: address == listen)
    members = Membership(("10.0.0.2:50051",), view=view)
    assert members.admits("10.0.0.2:50051") and not members.admits("10.0.0.7:50051")
    view.update("k8s", ["10.0.0.7:50051", "10.0.0.8:50051"])  # the Service's slices as the watch saw them
    assert members.admits("10.0.0.7:50051") and members.admits("10.0.0.8:50051")
    assert all(members.admits(m) for m in view.fleet().members)
    view.update("k8s", ["10.0.0.8:50051"])  # 10.0.0.7's pod left its Service
    assert not members.admits("10.0.0.7:50051") and members.admits("10.0.0.8:50051")
    with pytest.raises(NotAMember):
        members.check_named("10.0.0.7:50051")


def test_a_certificate_that_proves_membership_admits_any_address() -> None:
    assert Membership((), proven_by_certificate=True).admits("203.0.113.9:50051")


@pytest.mark.parametrize(
    ("kwargs", "refused"),
    [
        ({}, True),
        ({"anonymous_non_members": True}, False),
        ({"has_credential": False}, False),  # nothing to withhold: dialled as before
    ],
)
def test_a_caller_named_non_member_is_refused_by_name_unless_nothing_is_withheld(kwargs, refused) -> None:
    members = Membership(("10.0.0.5:50051",), **kwargs)
    members.check_named("10.0.0.5:50051")
    if refused:
        with pytest.raises(NotAMember) as caught:
            members.check_named("198.51.100.7:50051")
        assert isinstance(caught.value, PermissionDenied)
        assert "'198.51.100.7:50051' is not a member" in str(caught.value) and "--non-member-peers anonymous" in str(caught.value)
    else:
        members.check_named("198.51.100.7:50051")


def _call(channels: PeerChannels, address: str) -> None:
    with pytest.raises(grpc.RpcError):
        fabric_pb2_grpc.FabricStub(channels.get(address)).GetManifest(fabric_pb2.GetManifestRequest(adapter_id="team-a/x"), timeout=10)


def test_the_token_and_the_caller_go_to_members_only() -> None:
    with HeaderRecorder() as member, HeaderRecorder() as stranger:
        channels = PeerChannels(token=PEER_TOKEN, members=Membership((member.address,)))
        for view in (channels, channels.for_caller(CALLER)):
            _call(view, member.address)
            _call(view, stranger.address)
        channels.close()
    assert member.headers(AUTH_METADATA_KEY) == [f"Bearer {PEER_TOKEN}"] * 2
    assert member.headers(ON_BEHALF_OF_KEY) == [CALLER]  # the view for the caller names it; the node's own calls do not
    assert len(stranger.calls) == 2
    assert stranger.headers(AUTH_METADATA_KEY) == [] and stranger.headers(ON_BEHALF_OF_KEY) == []


def test_without_membership_a_library_channel_sends_its_token_everywhere_as_before() -> None:
    with HeaderRecorder() as anyone:
        channels = PeerChannels(token=PEER_TOKEN)
        _call(channels, anyone.address)
        channels.close()
    assert anyone.headers(AUTH_METADATA_KEY) == [f"Bearer {PEER_TOKEN}"]


@pytest.mark.parametrize("member", [True, False])
def test_the_data_channel_hello_carries_the_token_and_the_caller_to_members_only(member) -> None:
    with HelloRecorder() as server:
        peer = "127.0.0.1:50999"  # the gRPC address the data port was announced for
        data = DataChannels(token=PEER_TOKEN, members=Membership((peer,) if member else ()))
        data.learn(peer, announce_data_port(server.port))
        call = data.open(peer, fabric_pb2.FetchRequest(digest="cd" * 32), None, 4096, behalf=CALLER)
        assert call is not None
        assert server.received.wait(10)
        call.cancel()
    [hello] = server.hellos
    assert hello.fetch.digest == "cd" * 32
    assert (hello.token, hello.on_behalf_of) == ((PEER_TOKEN, CALLER) if member else ("", ""))


def test_a_resolver_that_hangs_holds_up_no_question_past_the_deadline_and_runs_once() -> None:
    """--peers-dns without placement: the resolution runs outside Membership's lock, one at a time, and a question waits
    for it at most the deadline; then the last answer stands, and the resolution's answer counts once it comes. (Resolved
    under the lock, every question, from every thread, waited for the hung resolver.)"""
    release, started = threading.Event(), []

    def resolve() -> list[str]:
        started.append(1)
        release.wait(60)  # a resolver that hangs until released (bounded, so a failure cannot hang the suite)
        return ["10.0.0.5:50051"]

    members = Membership(("10.0.0.2:50051",), resolve, deadline=0.01)
    answers: list[bool] = []
    askers = [threading.Thread(target=lambda: answers.append(members.admits("10.0.0.5:50051"))) for _ in range(8)]
    for asker in askers:
        asker.start()
    for asker in askers:
        asker.join(30)  # a bound on hanging: each returns after the 0.01 s deadline
    try:
        assert not any(asker.is_alive() for asker in askers), "a question waited for the hung resolver"
        assert answers == [False] * 8 and len(started) == 1  # no answer yet; one resolution under way, not one per question
        assert members.admits("10.0.0.2:50051")  # --peers never waits
    finally:
        release.set()
    wait_for(lambda: members.admits("10.0.0.5:50051"), what="the resolution's answer")
    assert len(started) == 1


def test_peers_that_refused_a_stream_beside_ours_are_remembered_for_a_while_and_boundedly(monkeypatch) -> None:
    from adapter_fabric.transport import channels as channels_module

    clock = [1000.0]
    monkeypatch.setattr(channels_module.time, "monotonic", lambda: clock[0])
    peers = PeerChannels()
    assert peers.takes_streams_beside("a:1")
    peers.refused_beside("a:1")
    assert not peers.takes_streams_beside("a:1") and not peers.for_caller("team").takes_streams_beside("a:1")  # one pool
    clock[0] += channels_module.ONE_STREAM_S + 1
    assert peers.takes_streams_beside("a:1")  # then two are tried again
    for n in range(channels_module.MAX_ONE_STREAM_PEERS + 5):
        peers.refused_beside(f"p{n}:1")
    assert not peers.takes_streams_beside(f"p{channels_module.MAX_ONE_STREAM_PEERS + 4}:1")
    assert peers.takes_streams_beside("p0:1")  # the oldest are forgotten first
    marked = [n for n in range(channels_module.MAX_ONE_STREAM_PEERS + 5) if not peers.takes_streams_beside(f"p{n}:1")]
    assert marked == list(range(5, channels_module.MAX_ONE_STREAM_PEERS + 5))  # the bound: exactly the newest are kept
