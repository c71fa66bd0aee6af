"""A Stage stream a test drives message by message, against a real node (tests/node/test_stage_uploads.py and others)."""

from __future__ import annotations

import queue
import threading

import grpc
from blake3 import blake3

from adapter_fabric.v1 import fabric_pb2
from tests.support.store import stage_begin_of


class Stream:
    """A Stage stream under the test's control: messages go out when the test puts them."""

    def __init__(self, stub) -> None:
        self._queue: queue.Queue = queue.Queue()
        self.reply: fabric_pb2.StageResponse | None = None
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._run, args=(stub,), daemon=True)
        self._thread.start()

    def _messages(self):
        while (message := self._queue.get()) is not None:
            if isinstance(message, Exception):
                raise message  # the client dies mid-stream: gRPC cancels the call
            yield message

    def _run(self, stub) -> None:
        try:
            self.reply = stub.Stage(self._messages(), timeout=120)
        except grpc.RpcError as exc:
            self.error = exc

    def begin(self, adapter_id: str, config: bytes, weights: bytes, offset: int = 0) -> None:
        self._queue.put(fabric_pb2.StageRequest(begin=stage_begin_of(adapter_id, config, weights, offset=offset)))

    def data(self, offset: int, data: bytes) -> None:
        self._queue.put(fabric_pb2.StageRequest(data=fabric_pb2.StageData(offset=offset, data=data)))

    def crash(self, timeout: float = 60) -> "Stream":
        self._queue.put(ConnectionAbortedError("simulated client crash"))
        self._thread.join(timeout)
        return self

    def end(self, timeout: float = 120) -> "Stream":
        self._queue.put(None)
        self._thread.join(timeout)
        return self

    def wait(self, timeout: float = 60) -> "Stream":
        self._thread.join(timeout)
        return self


def wait_offset(stub, adapter_id: str, weights: bytes, offset: int) -> None:
    """Until the node holds ``offset`` bytes of the upload (so it is open)."""
    request = fabric_pb2.UploadOffsetRequest(adapter_id=adapter_id, safetensors_blake3=blake3(weights).hexdigest())
    while stub.UploadOffset(request, timeout=30).offset < offset:
        pass
