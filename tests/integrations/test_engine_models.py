"""Reading an engine's GET /v1/models (adapter_fabric.integrations.engine_models) and naming the ids it registered
(adapter_fabric.node.engines), against a real HTTP server answering what vLLM and SGLang answer, and what they do not."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import pytest

from adapter_fabric.errors import PeerUnavailable
from adapter_fabric.integrations.engine_models import MAX_REPLY_BYTES, EngineLoRA, read_models
from adapter_fabric.node.engines import registered_ids

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
    assert read_models(url, 5) == [EngineLoRA("team-a/support", "/export/team-a%2Fsupport"), EngineLoRA("mine", "/opt/loras/mine")]


@pytest.mark.parametrize(
    ("status", "body", "needle"),
    [
        (500, b"oops", "HTTP 500"),
        (200, b"<html>", "no OpenAI model list"),
        (200, b'{"data": 5}', "no OpenAI model list"),
        (200, b"x" * (MAX_REPLY_BYTES + 10), f"more than {MAX_REPLY_BYTES} bytes"),
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
