"""HTTP servers answering as inference engines do, and as hostile ones might (in the test's process, on threads).

``FakeEngine`` answers ``GET /v1/models`` as vLLM and SGLang do (``cards``), or, by ``mode``: a body given as
bytes (nested JSON, a huge list), one byte every ``drip_s`` seconds for as long as the reader stays, or a
redirect to another server. ``FakeSGLang`` is SGLang 0.5.23's three LoRA routes with its answer texts; a load
can be held at a gate (``hold_loads``) until the test opens it, and its list can drip or nest like the above.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

#: a /v1/models reply nested deeper than json's decoder recurses
NESTED = b'{"data": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def models_reply(cards: list[dict]) -> bytes:
    return json.dumps({"object": "list", "data": [{"object": "model", **c} for c in cards]}).encode()


class _Server:
    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.label = self.url.removeprefix("http://")
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def answer(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def drip(self, every: float) -> None:
        """Headers promising a large body, then one byte every ``every`` seconds until the reader goes."""
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(1 << 20))
        self.end_headers()
        try:
            while True:
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(every)
        except OSError:
            return  # the reader went


class FakeEngine(_Server):
    """``GET /v1/models`` as an engine answers it (``mode`` "list"), or: "body" (``body`` as given), "drip", "redirect"."""

    def __init__(self) -> None:
        self.mode = "list"
        self.cards: list[dict] = []
        self.body = b""
        self.drip_s = 2.0
        self.redirect_to = ""
        self.reads = 0
        fake = self

        class Handler(_Handler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                fake.reads += 1
                if fake.mode == "drip":
                    self.drip(fake.drip_s)
                elif fake.mode == "redirect":
                    self.answer(302, b"", {"Location": fake.redirect_to + "/v1/models"})
                elif fake.mode == "body":
                    self.answer(200, fake.body)
                else:
                    self.answer(200, models_reply(fake.cards))

        super().__init__(Handler)

    def registers(self, *names_and_roots: tuple[str, str]) -> None:
        """List a base model and these adapters (name, root)."""
        self.mode = "list"
        self.cards = [{"id": "tiny", "root": "tiny", "parent": None}] + [{"id": n, "root": r, "parent": "tiny"} for n, r in names_and_roots]


class FakeSGLang(_Server):
    """SGLang's three LoRA routes over HTTP, with its answers (texts of LoRAManager and LoRARegistry, 0.5.23).

    ``models_mode``: "list" (what is loaded), "drip" or "body" (``models_body``), as ``FakeEngine``'s modes.
    ``hold_loads``: names whose load waits at ``gate`` (``load_started`` is set when one arrives); ``load_delay``: seconds
    every load waits before it answers (a slow SGLang).
    """

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.refuse_unload: set[str] = set()
        self.calls: list[tuple[str, str]] = []
        self.models_mode = "list"
        self.models_body = b""
        self.hold_loads: set[str] = set()
        self.load_delay = 0.0
        self.gate = threading.Event()
        self.load_started = threading.Event()
        fake = self

        class Handler(_Handler):
            def reply(self, code: int, body: object) -> None:
                self.answer(code, json.dumps(body).encode())

            def do_GET(self) -> None:  # noqa: N802
                if fake.models_mode == "drip":
                    self.drip(2.0)
                elif fake.models_mode == "body":
                    self.answer(200, fake.models_body)
                else:
                    cards = [{"id": "base", "root": "base", "parent": None}]
                    cards += [{"id": n, "root": p, "parent": "base"} for n, p in dict(fake.loaded).items()]
                    self.answer(200, models_reply(cards))

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                name = body["lora_name"]
                fake.calls.append((self.path, name))
                ok, message = True, None
                if self.path == "/load_lora_adapter":
                    time.sleep(fake.load_delay)
                    if name in fake.hold_loads:
                        fake.load_started.set()
                        fake.gate.wait()
                    if name in fake.loaded:
                        ok, message = False, f"Failed to load LoRA adapter {name} because it is already loaded"
                    elif not Path(body["lora_path"]).is_dir():
                        ok, message = False, f"Repository Not Found for url: {body['lora_path']}"
                    else:
                        fake.loaded[name] = body["lora_path"]
                elif name in fake.refuse_unload:
                    ok, message = False, "an unload in flight"
                elif name not in fake.loaded:
                    ok, message = False, f"LoRA with name {name} does not exist. Loaded LoRAs: {list(fake.loaded)}"
                else:
                    del fake.loaded[name]
                self.reply(200 if ok else 400, {"success": ok, "error_message": message, "loaded_adapters": dict(fake.loaded)})

        super().__init__(Handler)

    def close(self) -> None:
        self.gate.set()
        super().close()
