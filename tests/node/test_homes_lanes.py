"""A home's announcements do not wait behind its pushes: a push takes a whole pull's time (up to 120 s), and with both
on the same two threads, two slow pushes held every announcement (a re-homing's, a pull's) until they ended.

In-process: the node's ``Homes`` over a ``MemberView`` whose other member is a real gRPC server that blocks every
Promote (a push) until released, and records every Announce.
"""

from __future__ import annotations

import threading
from concurrent import futures

import grpc

from adapter_fabric.node.homes import Homes
from adapter_fabric.node.keyed_jobs import CONCURRENT
from adapter_fabric.store import AdapterStore
from adapter_fabric.transport.channels import PeerChannels
from adapter_fabric.transport.members import MemberView
from adapter_fabric.v1 import fabric_pb2, fabric_pb2_grpc
from tests.support.waiting import wait_for

ME = "127.0.0.1:1"


class SlowHome(fabric_pb2_grpc.FabricServicer):
    """A member whose Promote blocks until ``release`` is set; its Announces are recorded."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.pushes_started = 0
        self.told: list[str] = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        fabric_pb2_grpc.add_FabricServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"

    def Promote(self, request, context):
        self.pushes_started += 1
        self.release.wait(60)
        return fabric_pb2.PromoteResponse()

    def Announce(self, request, context):
        self.told.append(request.adapter_id)
        return fabric_pb2.AnnounceResponse()


def test_an_announcement_goes_out_while_every_push_thread_waits_on_a_slow_home(tmp_path) -> None:
    home = SlowHome()
    home.server.start()
    view = MemberView(ME, [home.address], is_self=lambda address, listen: address == listen)
    homes = Homes(view, 1, PeerChannels(), AdapterStore(tmp_path / "store", chunk_size=4096), lambda: 0)
    try:
        for i in range(CONCURRENT + 1):  # every push thread busy, one more push waiting
            assert homes.push(f"team/slow-{i}", home.address, "rehome")
        wait_for(lambda: home.pushes_started == CONCURRENT, what="every push thread to wait on the slow home")
        assert homes._tell(home.address, "team/told", "ab" * 32)
        wait_for(lambda: home.told == ["team/told"], what="the announcement to reach the home while the pushes wait", timeout=30)
        assert home.pushes_started == CONCURRENT and not home.release.is_set()
    finally:
        home.release.set()
        homes.close()
        home.server.stop(None)
