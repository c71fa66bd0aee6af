"""One deadline per fetch, held by every origin client: an endpoint that accepts and never answers is refused as
``OriginTooSlow`` (not "unavailable"), with nothing written, and no retry starts once the deadline has passed."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from adapter_fabric.errors import OriginTooSlow
from adapter_fabric.origins import bounded
from adapter_fabric.origins.base import FetchLimits
from adapter_fabric.origins.uri import open_origin, parse_origin

TIMEOUT_S = 1.0


class SilentEndpoint:
    """A TCP listener that accepts every connection, counts it, and never sends a byte."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


@pytest.fixture()
def silent() -> Iterator[SilentEndpoint]:
    endpoint = SilentEndpoint()
    yield endpoint
    endpoint.close()


def _fetch_refused_as_too_slow(uri: str, adapter_id: str, tmp_path: Path) -> None:
    into = tmp_path / "into"
    into.mkdir()
    origin = open_origin(parse_origin(f"{uri}#timeout={TIMEOUT_S:g}s"))
    with pytest.raises(OriginTooSlow, match=f"not done within the origin's timeout of {TIMEOUT_S:g}s"):
        origin.fetch(adapter_id, "", None, into, FetchLimits(1 << 20, timeout=TIMEOUT_S))
    assert not any(path.stat().st_size for path in into.iterdir())


def test_a_silent_http_origin_is_too_slow_after_one_attempt_that_waited_out_the_deadline(silent: SilentEndpoint, tmp_path: Path) -> None:
    _fetch_refused_as_too_slow(silent.url, "team-a/support", tmp_path)
    # was: OriginUnavailable "Read timed out", after 3 attempts each given the whole timeout (3.4 s for a 1 s deadline)
    assert len(silent.accepted) == 1


def test_a_silent_s3_endpoint_is_too_slow(silent: SilentEndpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("boto3")
    for key, value in {"AWS_ENDPOINT_URL": silent.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(key, value)
    _fetch_refused_as_too_slow("s3://adapters/cust", "team-a/support", tmp_path)  # was: OriginUnavailable "did not answer"
    assert 1 <= len(silent.accepted) <= 3  # botocore's three tries share the deadline


def test_a_silent_hub_is_too_slow(silent: SilentEndpoint, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", silent.url)  # read at import; the suite imported it already
    _fetch_refused_as_too_slow("hf://", "team-a/support", tmp_path)  # was: OriginUnavailable "the Hub did not answer"
    assert 1 <= len(silent.accepted) <= 3


def test_a_read_that_fails_at_the_deadline_before_the_watchdog_runs_is_too_slow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under load the client's own read timeout can fire at the deadline before the watchdog's timer thread runs."""

    @contextmanager
    def late_watchdog(limits: FetchLimits, close: object) -> Iterator[threading.Event]:
        yield threading.Event()  # the timer has not run yet

    monkeypatch.setattr(bounded, "watchdog", late_watchdog)
    limits = FetchLimits(1 << 20, timeout=0.05)

    def read(_: int) -> bytes:
        time.sleep(max(0.0, limits.deadline - time.monotonic()) + 0.01)
        raise TimeoutError("timed out")

    with pytest.raises(OriginTooSlow, match="not received within the origin's timeout"):  # was: the TimeoutError itself
        bounded.copy_to_file(read, lambda: None, tmp_path / "file", "adapter_model.safetensors", limits, "origin x: team-a/y")
    assert (tmp_path / "file").stat().st_size == 0
