"""Safe start-up, in real ``fabric-node`` processes: every bad flag or variable is one line and status 2 (as ``fabric``), every bad file or busy port one line and status 1."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest

from adapter_fabric import __version__
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.node.flag_values import boolean, duration, evict_to, host_port, positive_int
from adapter_fabric.node.main import main as node_main
from adapter_fabric.node.settings import parse_settings
from tests.support.certs import TestCA

TIMEOUT_S = 120


def run_node(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A node process that is expected to stop at start (or print and exit: --help, --version)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FABRIC_")}
    return subprocess.run(
        [sys.executable, "-m", "adapter_fabric.node.main", *args], capture_output=True, text=True, timeout=TIMEOUT_S, env={**clean, **(env or {})}
    )


def one_line_failure(done: subprocess.CompletedProcess, *needles: str, code: int = 1) -> str:
    """The process exited ``code`` (1: start-up failed; 2: a bad flag or variable) with one stderr line holding every needle, and never said "listening"."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == code, done.stderr
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and "listening" not in done.stdout
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def store_only(tmp_path: Path, *more: str) -> list[str]:
    return ["--model", "none", "--store", str(tmp_path / "store"), "--listen", "127.0.0.1:0", *more]


@pytest.fixture(scope="module")
def ca(tmp_path_factory) -> TestCA:
    return TestCA(tmp_path_factory.mktemp("pki") / "ca")


# ---------------------------------------------------------------- ports


def test_a_start_that_fails_leaves_the_garbage_collector_on() -> None:
    """main() turns the collector off for the start (the node turns it back on once built): a refused flag, here
    in-process, must not leave it off."""
    assert gc.isenabled()
    with pytest.raises(SystemExit):
        node_main(["--no-such-flag"])
    assert gc.isenabled()


@pytest.mark.slow
def test_a_second_node_on_a_busy_port_exits_1_naming_the_port(tmp_path) -> None:
    with LocalNode(tmp_path / "first", model="none") as first:
        port = first.address.rsplit(":", 1)[1]
        for host in ("127.0.0.1", "0.0.0.0"):
            done = run_node(["--model", "none", "--store", str(tmp_path / "second"), "--listen", f"{host}:{port}"])
            one_line_failure(done, "--listen", port, "already in use")
        assert first.process.poll() is None  # the first node was not disturbed
        assert first.client().list().staged == []


@pytest.mark.slow
def test_a_second_node_on_the_same_store_exits_1_naming_the_first(tmp_path) -> None:
    """Issue 33: two nodes shared one --store without a word (each would take the other's uploads for abandoned ones)."""
    with LocalNode(tmp_path / "shared", model="none") as first:
        done = run_node(["--model", "none", "--store", str(first.store), "--listen", "127.0.0.1:0"])
        one_line_failure(done, f"--store {first.store} is in use by another fabric-node", f"pid {first.pid}, listening on {first.address}", "give each node its own --store")
        assert first.process.poll() is None and first.client().list().staged == []  # the first node was not disturbed
    # once it stopped, the store is free again (the lock goes with the process)
    with LocalNode(tmp_path / "shared", model="none") as again:
        assert again.client().list().staged == []


@pytest.mark.slow
def test_a_busy_metrics_port_exits_1_naming_the_flag(tmp_path) -> None:
    with LocalNode(tmp_path / "first", model="none", extra_args=["--metrics-listen", "127.0.0.1:0"]) as first:
        port = first.metrics_address.rsplit(":", 1)[1]
        one_line_failure(run_node(store_only(tmp_path, "--metrics-listen", f"127.0.0.1:{port}")), "--metrics-listen", port, "already in use")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("listen", "needles", "code"),
    [
        ("127.0.0.1:99999", ("--listen", "99999", "port from 0 to 65535"), 2),  # malformed: a usage error
        ("127.0.0.1:-1", ("--listen", "port from 0 to 65535"), 2),
        ("nonsense", ("--listen", "nonsense", "HOST:PORT"), 2),
        ("no-such-host.invalid:5000", ("--listen", "does not resolve"), 1),  # well-formed, but start-up fails
        ("192.0.2.1:5000", ("--listen", "not an address of this machine"), 1),
    ],
)
def test_an_invalid_listen_address_is_one_line(tmp_path, listen, needles, code) -> None:
    one_line_failure(run_node(["--model", "none", "--store", str(tmp_path / "s"), "--listen", listen]), *needles, code=code)


# ---------------------------------------------------------------- files


@pytest.mark.slow
def test_swapped_tls_cert_and_key_are_named(tmp_path, ca) -> None:
    files = ca.issue("node")
    one_line_failure(
        run_node(store_only(tmp_path, "--tls-cert", str(files.key), "--tls-key", str(files.cert))), "--tls-cert", "swapped"
    )


@pytest.mark.slow
def test_unreadable_and_non_pem_tls_files_are_named(tmp_path, ca) -> None:
    files = ca.issue("node")
    one_line_failure(run_node(store_only(tmp_path, "--tls-cert", str(tmp_path / "missing.pem"), "--tls-key", str(files.key))), "cannot read the TLS certificate", "missing.pem")
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    one_line_failure(run_node(store_only(tmp_path, "--tls-cert", str(files.cert), "--tls-key", str(junk))), "--tls-key", "no PEM private key")


@pytest.mark.slow
def test_an_unusable_store_path_is_named(tmp_path) -> None:
    one_line_failure(run_node(["--model", "none", "--store", "/dev/null/x", "--listen", "127.0.0.1:0"]), "--store", "/dev/null/x", "Not a directory")


@pytest.mark.slow
def test_a_store_of_digest_scheme_1_is_refused_by_name_and_left_as_it_was(tmp_path) -> None:
    """A store an older node wrote (sha256 blobs, no format file): one line naming both formats; not a file touched."""
    old = tmp_path / "old"
    (old / "blobs" / "sha256" / "ab").mkdir(parents=True)
    (old / "blobs" / "sha256" / "ab" / ("ab" * 32)).write_bytes(b"weights")
    (old / "refs").mkdir()
    (old / "refs" / "team-a%2Fx").write_text("cd" * 32)
    before = sorted((p.relative_to(old), p.read_bytes() if p.is_file() else None) for p in old.rglob("*"))
    one_line_failure(run_node(["--model", "none", "--store", str(old), "--listen", "127.0.0.1:0"]), "--store", "format '1'", "format 2", "new --store")
    assert sorted((p.relative_to(old), p.read_bytes() if p.is_file() else None) for p in old.rglob("*")) == before
    (tmp_path / "future").mkdir()
    (tmp_path / "future" / "format").write_text("3\n")
    one_line_failure(run_node(["--model", "none", "--store", str(tmp_path / "future"), "--listen", "127.0.0.1:0"]), "format '3'")


@pytest.mark.slow
@pytest.mark.parametrize("size", ["1", "4095", str((4 << 20) + 1)])
def test_a_chunk_size_outside_its_bounds_is_one_line(tmp_path, size) -> None:
    one_line_failure(run_node(store_only(tmp_path, "--chunk-size", size)), "--chunk-size", "4KiB to 4MiB", code=2)


# ---------------------------------------------------------------- environment


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "needles"),
    [
        ({"FABRIC_SLOTS": "abc"}, ("FABRIC_SLOTS", "'abc'", "positive integer")),
        ({"FABRIC_AUTH_PEER_READS": "ture"}, ("FABRIC_AUTH_PEER_READS", "'ture'", "true or false")),
        ({"FABRIC_MAX_STORE_BYTES": "-5"}, ("FABRIC_MAX_STORE_BYTES", "size 0 or more")),
        ({"FABRIC_STALL_TIMEOUT": "nan"}, ("FABRIC_STALL_TIMEOUT", "duration more than 0")),
        ({"FABRIC_DEVICE": "tpu"}, ("FABRIC_DEVICE", "auto, cpu, cuda")),
        ({"FABRIC_METRICS_LISTEN": "127.0.0.1:70000"}, ("FABRIC_METRICS_LISTEN", "65535")),
        ({"FABRIC_PEERS": "a:1,b"}, ("FABRIC_PEERS", "HOST:PORT")),
        ({"FABRIC_EXPIRE_ABANDONED_AFTER": "soon"}, ("FABRIC_EXPIRE_ABANDONED_AFTER", "duration")),
        ({"FABRIC_EVICT_TO": "0.3"}, ("FABRIC_EVICT_TO", "'0.3'", "from 0.5 to 1.0")),
        ({"FABRIC_ENGINE_URL": "127.0.0.1:8000"}, ("FABRIC_ENGINE_URL", "not an http:// or https:// URL")),
        ({"FABRIC_ENGINE_URL": "http://e:1/?x=1"}, ("FABRIC_ENGINE_URL", "query or fragment")),
        ({"FABRIC_ENGINE_URL": ",".join(f"http://e{i}:1" for i in range(9))}, ("FABRIC_ENGINE_URL", "at most 8 engine URLs")),
        ({"FABRIC_ENGINE_URL": "http://" + "e" * 3000}, ("FABRIC_ENGINE_URL", "at most 2048")),
    ],
)
def test_bad_environment_values_are_one_line(tmp_path, env, needles) -> None:
    one_line_failure(run_node(store_only(tmp_path), env), *needles, code=2)


@pytest.mark.slow
def test_help_and_version_never_fail_whatever_the_environment() -> None:
    bad = {"FABRIC_SLOTS": "abc", "FABRIC_AUTH_PEER_READS": "ture", "FABRIC_LISTEN": "nonsense"}
    shown = run_node(["--help"], bad)
    assert shown.returncode == 0 and "FABRIC_SLOTS" in shown.stdout and "--metrics-listen" in shown.stdout
    version = run_node(["--version"], bad)
    assert version.returncode == 0 and version.stdout.strip() == f"fabric-node {__version__}"


@pytest.mark.slow
def test_a_bad_flag_is_one_line_with_status_2_as_fabric_usage_errors(tmp_path) -> None:
    one_line_failure(run_node(store_only(tmp_path, "--slots", "four")), "--slots", "'four'", "positive integer", code=2)
    one_line_failure(run_node(store_only(tmp_path, "--no-such-flag")), "unrecognized arguments", code=2)


# ---------------------------------------------------------------- the parsers themselves


def test_environment_values_are_parsed_strictly_and_flags_win(tmp_path) -> None:
    settings = parse_settings(["--slots", "3"], {"FABRIC_SLOTS": "9", "FABRIC_AUTH_PEER_READS": "on", "FABRIC_EXPIRE_ABANDONED_AFTER": "2h"})
    assert settings.slots == 3 and settings.auth_peer_reads is True and settings.expire_abandoned_after == 7200
    assert parse_settings([], {"FABRIC_SLOTS": ""}).slots == 4  # empty = unset
    for bad in ("ture", "", "2", "y"):
        with pytest.raises(ValueError, match="true or false"):
            boolean(bad)
    for bad in ("4.0", " 4", "0", "1e3", "+4"):
        with pytest.raises(ValueError):
            positive_int(bad)
    assert [duration(t) for t in ("90", "90s", "15m", "24h", "7d", "0")] == [90, 90, 900, 86400, 604800, 0]
    assert [evict_to(t) for t in ("0.5", "0.9", "1", "1.0")] == [0.5, 0.9, 1.0, 1.0]
    for bad in ("0.49", "1.01", "nan", "inf", "90%", "", "-0.9"):
        with pytest.raises(ValueError, match="share of --max-store-bytes from 0.5 to 1.0"):
            evict_to(bad)
    assert parse_settings([], {"FABRIC_WHEN_FULL": "refuse"}).durable and not parse_settings([]).durable
    with pytest.raises(ValueError):
        host_port("[::1]")
    assert host_port("[::1]:0") == "[::1]:0"
