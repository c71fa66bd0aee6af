"""Issue 33: what a newcomer trips on, said in words. Every CLI error names the input and the fix, never a Python
exception class; addresses, prefixes, adapter directories and make-adapter's seed behave as a user expects.

No node process: every case is refused (or done) before any call, or dials an address nothing listens on.
"""

from __future__ import annotations

import builtins
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter_fabric import InvalidAdapter, NodeClient
from adapter_fabric.cli.bulk_cmds import named_items
from adapter_fabric.cli.main import run
from adapter_fabric.trust.signing import keygen
from tests.support import ROOT

DEAD = "127.0.0.1:1"  # nothing listens there
#: every exception class Python itself defines (FileNotFoundError, ValueError, KeyError, ...): never in what fabric prints
PYTHON_EXCEPTIONS = sorted(name for name, value in vars(builtins).items() if isinstance(value, type) and issubclass(value, BaseException))
LEAKS = [*PYTHON_EXCEPTIONS, "Traceback", "Errno", "RpcError", "_InactiveRpcError", "<class "]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """An adapter directory (config and weights are placeholders: nothing here parses them), a non-key, a file."""
    root = tmp_path_factory.mktemp("words")
    adapter = root / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / "adapter_model.safetensors").write_bytes(b"\0" * 16)
    (root / "not-a-key").write_text("hello\n")
    (root / "author.key").write_bytes(keygen()[0])
    (root / "half").mkdir()
    (root / "half" / "adapter_config.json").write_text("{}")
    return {"root": root, "adapter": adapter, "not_a_key": root / "not-a-key", "weights": adapter / "adapter_model.safetensors"}


def bad_inputs(f: dict[str, Path]) -> list[tuple[list[str], str]]:
    """(argv, a word the refusal must contain: the input it names)."""
    root = f["root"]
    return [
        (["sign", str(f["adapter"]), "--key", str(root / "nope.key")], "--key"),
        (["sign", str(f["adapter"]), "--key", str(f["not_a_key"])], "--key"),
        (["sign", str(f["adapter"]), "--key", str(root)], "--key"),  # a directory
        (["sign", str(root / "no-dir"), "--key", str(root / "author.key")], "no-dir"),
        (["stage", DEAD, str(f["adapter"]), "--id", "a/b", "--sign-key", str(root / "nope")], "--sign-key"),
        (["stage", DEAD, str(f["weights"]), "--id", "a/b"], "is a file, not a directory"),
        (["stage", DEAD, str(root / "half"), "--id", "a/b"], "adapter_model.safetensors"),
        (["stage", DEAD, str(root / "gone"), "--id", "a/b"], "does not exist"),
        (["keygen", str(root / "nonexistent" / "dir" / "k")], "nonexistent"),
        (["make-adapter", "/proc/x"], "/proc/x"),
        (["make-adapter", str(f["not_a_key"])], "not-a-key"),
        (["demo", "--workdir", "/proc/nope"], "--workdir"),
        (["ls", "127.0.0.1:99999"], "port 99999 is out of range"),
        (["ls", "127.0.0.1:abc"], "port 'abc' is not a number"),
        (["ls", "localhost"], "names no port"),
        (["ls", DEAD, "--tls-ca", str(root / "nope.pem")], "nope.pem"),
        (["ls", DEAD, "--auth-token-file", str(root / "nope.token")], "nope.token"),
        (["ls", DEAD, "--auth-token-file", str(root)], str(root)),
        (["stage-many", DEAD, str(root / "gone1"), str(f["weights"]), "--prefix", "t"], "gone1"),
        (["generate", DEAD, "--tokens", "1,x"], "'x'"),
        (["pull", DEAD, "--from", DEAD, "--id", "a/b", "--timeout", "-1"], "--timeout"),
    ]


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_no_python_exception_name_is_printed_by_the_cli(files, capsys, as_json) -> None:
    for argv, named in bad_inputs(files):
        code = run([*argv, "--json"] if as_json else argv)
        out, err = capsys.readouterr()
        said = out + err
        assert code != 0, (argv, said)
        leaked = [name for name in LEAKS if name in said]
        assert not leaked, f"fabric {' '.join(argv)} printed {leaked}: {said}"
        assert named in said, f"fabric {' '.join(argv)} does not name {named!r}: {said}"
        if as_json:
            payload = json.loads(out)
            for error in [payload["error"]] if "error" in payload else [{"type": f["error"], **f} for f in payload["failed"]]:
                assert error["type"] not in PYTHON_EXCEPTIONS and error["message"], error
        else:
            assert len(err.strip().splitlines()) <= 6, err  # a line per failure (argparse's usage lines before a usage error)


def test_a_name_that_does_not_resolve_is_said_so_not_tls(capsys) -> None:
    assert run(["ls", "no-such-host.invalid:50051"]) == 3
    err = capsys.readouterr().err
    assert "does not resolve" in err and "--tls-ca" not in err and "fabric-node running" not in err, err


def test_stage_many_joins_a_prefix_with_a_slash(tmp_path) -> None:
    one = tmp_path / "my-adapter"
    assert named_items([str(one)], "team-x") == [(one, "team-x/my-adapter")]  # was team-xmy-adapter
    assert named_items([str(one)], "team-x/") == [(one, "team-x/my-adapter")]
    assert named_items([str(one)], "") == [(one, "my-adapter")]


def test_staging_a_file_says_to_give_its_directory(files) -> None:
    with NodeClient(DEAD) as client, pytest.raises(InvalidAdapter, match="is a file, not a directory: give the directory that holds it"):
        client.stage(files["weights"], "a/b")


def _make(where: Path, *flags: str, hash_seed: str = "0") -> dict:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    made = subprocess.run([sys.executable, "-m", "adapter_fabric.cli", "make-adapter", str(where), *flags, "--json"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout)


def test_make_adapter_is_random_by_default_and_one_seed_makes_the_same_bytes(tmp_path) -> None:
    """The README calls it random (four adapters made without --seed had the same weights); the seed it used is printed;
    the same seed makes the same files byte for byte, target_modules in one order whatever the process's string hashing."""
    # Three processes (make-adapter imports PEFT: ~6 CPU-seconds each): two without --seed, then a's seed again in a
    # process whose string hashing differs from a's.
    targets = ("--targets", "v_proj,q_proj,k_proj,o_proj")
    a, b = _make(tmp_path / "a", *targets, hash_seed="1"), _make(tmp_path / "b", *targets, hash_seed="2")
    assert a["seed"] != b["seed"]
    assert (tmp_path / "a" / "adapter_model.safetensors").read_bytes() != (tmp_path / "b" / "adapter_model.safetensors").read_bytes()
    again = _make(tmp_path / "s", "--seed", str(a["seed"]), *targets, hash_seed="2")
    assert again["seed"] == a["seed"]
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "s" / name).read_bytes(), name
    config = json.loads((tmp_path / "s" / "adapter_config.json").read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
