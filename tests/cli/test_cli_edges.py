"""Issue 18 item 8, CLI and client edges: no input ends in a traceback; every NodeClient call takes its own timeout."""

from __future__ import annotations

import json
import socket

import pytest

from adapter_fabric import InvalidArgument, NodeClient, PeerUnavailable
from adapter_fabric.cli.main import run
from adapter_fabric.client.node_client import DEFAULT_MAX_NEW_TOKENS

DEAD = "127.0.0.1:1"  # never dialled: each case below is refused before any call


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["generate", DEAD, "--tokens", "2147483648"], "0 to 2147483647"),
        (["generate", DEAD, "--tokens", "1,-3"], "0 to 2147483647"),
        (["generate", DEAD, "--tokens", "1", "--max-new-tokens", "-1"], "1 to 2147483647"),
        (["generate", DEAD, "--tokens", "1", "--max-new-tokens", "4294967296"], "1 to 2147483647"),
        (["make-adapter", "unused", "--model", "tiny", "--rank", "0"], "rank from 1 to 1024"),
        (["make-adapter", "unused", "--model", "tiny", "--rank", "-4"], "rank from 1 to 1024"),
    ],
)
def test_out_of_range_numbers_are_usage_errors_not_tracebacks(argv, needle, capsys) -> None:
    assert run(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err


def test_a_target_the_model_lacks_is_named(tmp_path, capsys) -> None:
    assert run(["make-adapter", str(tmp_path / "a"), "--model", "tiny", "--targets", "nope_proj", "--json"]) == 1
    error = json.loads(capsys.readouterr().out)["error"]
    assert error["type"] == "InvalidArgument" and "nope_proj" in error["message"]


def test_keygen_over_an_existing_key_says_why_in_text_and_json(tmp_path, capsys) -> None:
    out = str(tmp_path / "author")
    assert run(["keygen", out]) == 0
    before = (tmp_path / "author.key").read_bytes()
    capsys.readouterr()
    assert run(["keygen", out]) == 1
    assert "exists: not overwriting a key" in capsys.readouterr().err
    assert run(["keygen", out, "--json"]) == 1
    assert "not overwriting" in json.loads(capsys.readouterr().out)["error"]["message"]
    assert (tmp_path / "author.key").read_bytes() == before


def test_generate_refuses_what_the_wire_cannot_carry_before_sending() -> None:
    with NodeClient(DEAD) as client:
        for ids, count in (([1 << 31], 4), ([1], -1), ([1], 1 << 32)):
            with pytest.raises(InvalidArgument, match="generate"):
                client.generate(ids, max_new_tokens=count)


def test_each_call_takes_its_own_timeout() -> None:
    """A listener that accepts and never answers: each call ends at its own deadline, naming the node."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with NodeClient(address, timeout=600.0) as client:
            for call in (lambda: client.generate([1, 2], timeout=0.5), lambda: client.list(timeout=0.5),
                         lambda: client.store_status(timeout=0.5), lambda: client.manifest("a", timeout=0.5)):
                with pytest.raises(PeerUnavailable, match=address):
                    call()


def test_generate_asks_for_as_many_tokens_as_the_cli() -> None:
    import inspect

    assert inspect.signature(NodeClient.generate).parameters["max_new_tokens"].default == DEFAULT_MAX_NEW_TOKENS == 8
