"""Issue 33, the adapter author: signatures are visible (inspect, text and --json) and fabric sign's output is what a
command accepts (fabric stage --signature), against a real node."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from adapter_fabric.harness.cluster import LocalNode, free_port
from adapter_fabric.serving.tiny import make_peft_adapter
from tests.support import ROOT

pytestmark = pytest.mark.slow  # a real node process


def fabric(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "adapter_fabric.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_a_signature_made_apart_is_attached_by_stage_and_shown_by_inspect(tmp_path) -> None:
    adapter = make_peft_adapter(tmp_path / "adapter", r=4, seed=31)
    other = make_peft_adapter(tmp_path / "other", r=4, seed=32)
    with LocalNode(tmp_path / "n", model="none", port=free_port()) as node:
        made = json.loads(fabric("keygen", str(tmp_path / "author"), "--json").stdout)
        signer = made["signer"]
        assert len(signer) == 64

        signed = fabric("sign", str(adapter), "--key", str(tmp_path / "author.key"), "--out", str(tmp_path / "adapter.sig"))
        assert signed.returncode == 0 and f"--signature {tmp_path / 'adapter.sig'}" in signed.stdout, signed.stdout + signed.stderr
        staged = fabric("stage", node.address, str(adapter), "--id", "me/signed", "--signature", str(tmp_path / "adapter.sig"))
        assert staged.returncode == 0, staged.stderr

        shown = json.loads(fabric("inspect", node.address, "--id", "me/signed", "--json").stdout)
        assert shown["signers"] == [signer]
        text = fabric("inspect", node.address, "--id", "me/signed").stdout
        assert f"signed by 1: {signer}" in text, text

        # signed while staging: the same signer shows on that adapter
        assert fabric("stage", node.address, str(other), "--id", "me/other", "--sign-key", str(tmp_path / "author.key")).returncode == 0
        assert json.loads(fabric("inspect", node.address, "--id", "me/other", "--json").stdout)["signers"] == [signer]

        # a signature over other bytes, or at another chunk size, is refused before any byte is sent, naming the fix
        for wrong, flags in (("other.sig", ("sign", str(other))), ("chunked.sig", ("sign", str(adapter), "--chunk-size", "64KiB"))):
            assert fabric(*flags, "--key", str(tmp_path / "author.key"), "--out", str(tmp_path / wrong)).returncode == 0
            refused = fabric("stage", node.address, str(adapter), "--id", "me/wrong", "--signature", str(tmp_path / wrong), "--json")
            error = json.loads(refused.stdout)["error"]
            assert refused.returncode == 1 and error["type"] == "BadSignature" and "--chunk-size 1MiB" in error["message"], error
        listed = fabric("ls", node.address, "--json").stdout
        assert "me/wrong" not in listed

        plain = make_peft_adapter(tmp_path / "plain", r=4, seed=33)
        assert fabric("stage", node.address, str(plain), "--id", "me/plain").returncode == 0
        assert json.loads(fabric("inspect", node.address, "--id", "me/plain", "--json").stdout)["signers"] == []
        assert "unsigned (fabric stage --sign-key KEY, or --signature FILE, signs it)" in fabric("inspect", node.address, "--id", "me/plain").stdout
