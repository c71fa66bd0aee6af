"""Reading an engine's GET /v1/models (adapter_fabric.integrations.engine_models) and naming the ids it registered
(adapter_fabric.node.engines), against a real HTTP server answering what vLLM and SGLang answer, and what they do not."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from adapter_fabric.errors import PeerUnavailable
from adapter_fabric.integrations.engine_models import MAX_CARDS, MAX_REPLY_BYTES, EngineList, EngineLoRA, read_models
from adapter_fabric.node.engines import registered_ids
from tests.support.fake_engines import NESTED, FakeEngine, models_reply

#: vLLM 0.34's OpenAIServingModels.show_available_models, dumped (SGLang's cards have the same fields)
VLLM_REPLY = {
    "object": "list",
    "data": [
        {"id": "tiny", "object": "model", "root": "tiny", "parent": None},
        {"id": "team-a/support", "object": "model", "root": "/export/team-a%2Fsupport", "parent": "tiny"},
        {"id": "mine", "object": "model", "root": "/opt/loras/mine", "parent": "tiny"},
    ],
}


@pytest.fixture
def engine() -> Iterator[tuple[str, dict]]:
    """A real HTTP server whose /v1/models answers ``answer["body"]`` (bytes) with ``answer["status"]``."""
    answer: dict = {"status": 200, "body": json.dumps(VLLM_REPLY).encode()}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(answer["status"])
            self.end_headers()
            self.wfile.write(answer["body"])

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", answer
    server.shutdown()


def test_adapter_cards_are_read_and_base_models_left_out(engine) -> None:
    url, _ = engine
    assert read_models(url, 5) == EngineList((EngineLoRA("team-a/support", "/export/team-a%2Fsupport"), EngineLoRA("mine", "/opt/loras/mine")))


@pytest.mark.parametrize(
    ("status", "body", "needle"),
    [
        (500, b"oops", "HTTP 500"),
        (200, b"<html>", "no JSON this node reads"),
        (200, b'{"data": 5}', "no OpenAI model list"),
    ],
)
def test_an_engine_answering_something_else_is_named(engine, status, body, needle) -> None:
    url, answer = engine
    answer.update(status=status, body=body)
    with pytest.raises(PeerUnavailable, match=needle):
        read_models(url, 5)


def test_an_engine_not_listening_is_named() -> None:
    with pytest.raises(PeerUnavailable, match="did not answer GET /v1/models"):
        read_models("http://127.0.0.1:9", 5)


def test_ids_come_from_the_export_entry_then_from_the_name() -> None:
    cards = [
        EngineLoRA("alias", "/export/team-a%2Fsupport/"),  # an entry of the export directory, under another name
        EngineLoRA("team-c/y", "/mnt/elsewhere/team-c%2Fy"),  # the export volume mounted elsewhere: named by its id
        EngineLoRA("team-b/x", "/opt/loras/x"),  # the operator's own, named like an id: counted by its name
        EngineLoRA("not an id!", "/opt/loras/team-a%2Fsupport2"),  # neither: not this node's
        EngineLoRA("not an id either", "/export/%old-123-team-a%2Fz"),  # a withdrawn entry is no export name
    ]
    assert registered_ids(cards, "/export") == {"team-a/support", "team-c/y", "team-b/x"}
    assert registered_ids(cards, None) == {"alias", "team-c/y", "team-b/x"}  # no export directory: names only


# ---------------------------------------------------------------- hostile engines (tests/support/fake_engines.py)


@pytest.fixture
def fake() -> Iterator[FakeEngine]:
    engine = FakeEngine()
    yield engine
    engine.close()


def test_a_reply_too_large_to_take_whole_is_cut_and_says_why(fake) -> None:
    fake.mode, fake.body = "body", b"x" * (MAX_REPLY_BYTES + 10)
    assert read_models(fake.url, 5) == EngineList((), cut=f"its GET /v1/models reply is over {MAX_REPLY_BYTES} bytes (not read)")


def test_an_engine_that_drips_is_cut_at_the_whole_reply_deadline(fake) -> None:
    fake.mode, fake.drip_s = "drip", 0.2  # every read of the socket gets a byte well inside any per-read timeout
    with pytest.raises(PeerUnavailable, match=r"did not answer GET /v1/models within 1s \(a bound on the whole reply\)"):
        read_models(fake.url, 1)


def test_json_nested_past_the_decoders_depth_is_named(fake) -> None:
    fake.mode, fake.body = "body", NESTED
    with pytest.raises(PeerUnavailable, match="no JSON this node reads \\(RecursionError"):
        read_models(fake.url, 5)


def test_a_redirect_is_not_followed(fake) -> None:
    other = FakeEngine()
    other.registers(("team-a/x", "/export/team-a%2Fx"))
    fake.mode, fake.redirect_to = "redirect", other.url
    try:
        with pytest.raises(PeerUnavailable, match=f"HTTP 302, a redirect to '{other.url}/v1/models'.*no redirect is followed"):
            read_models(fake.url, 5)
        assert other.reads == 0
    finally:
        other.close()


def test_every_card_is_read_and_a_list_of_more_adapters_than_max_cards_is_cut(fake) -> None:
    fake.mode = "body"
    fake.body = models_reply([{"id": f"base-{i}", "parent": None} for i in range(MAX_CARDS + 50_000)] + [{"id": "a", "root": "/e/a", "parent": "b"}])
    assert read_models(fake.url, 30) == EngineList((EngineLoRA("a", "/e/a"),))  # base-model cards count for nothing
    fake.body = models_reply([{"id": f"a{i}", "root": f"/e/a{i}", "parent": "b"} for i in range(MAX_CARDS + 1)])
    listed = read_models(fake.url, 30)
    assert len(listed.adapters) == MAX_CARDS and listed.cut == f"it lists more than {MAX_CARDS} adapters (the rest not read)"
