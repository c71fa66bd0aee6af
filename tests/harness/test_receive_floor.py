"""The floor beside a promote (adapter_fabric.harness.receive_floor) receives every byte, in order, into the row; it
leaves no file behind and refuses a row too small for the payload before it connects."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from adapter_fabric.harness.bench import ServerProcess, TransferPath
from adapter_fabric.harness.receive_floor import CHUNK, receive_floor


@pytest.fixture
def served(tmp_path: Path):
    payload = os.urandom(3 * CHUNK + 4099)  # a short last chunk, not a multiple of a page
    (tmp_path / "payload").write_bytes(payload)
    server = ServerProcess(TransferPath("raw socket", "raw-socket", "raw-socket"), str(tmp_path / "payload"))
    yield server.port, payload
    server.close()


def test_the_floor_lands_the_payload_in_the_row_and_removes_its_file(served, tmp_path: Path) -> None:
    port, payload = served
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    row = memoryview(bytearray(len(payload) + 7))
    seconds, cpu = receive_floor(port, len(payload), row, scratch)
    assert bytes(row[: len(payload)]) == payload and bytes(row[len(payload) :]) == bytes(7)
    assert seconds > 0 and cpu >= 0
    assert list(scratch.iterdir()) == []


def test_a_row_smaller_than_the_payload_is_refused_by_size(served, tmp_path: Path) -> None:
    port, payload = served
    with pytest.raises(ValueError, match=f"the row holds {len(payload) - 1} bytes, the payload is {len(payload)}"):
        receive_floor(port, len(payload), memoryview(bytearray(len(payload) - 1)), tmp_path)
    assert list(tmp_path.iterdir()) == [tmp_path / "payload"]
