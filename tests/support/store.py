"""Shared by the manifest and store tests: real PEFT adapters made once, and store snapshots."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest

SMALL_CHUNK = 4096  # tiny adapters are ~15 KB: several chunks each


def make_adapters(out: Path) -> dict[str, Path]:
    """Real adapters written by PEFT's save_pretrained, plus hand-broken copies of them."""
    from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter

    base = build_tiny_model()
    dirs = {
        "a": make_peft_adapter(out / "a", base_model=base, seed=1, r=8),
        "b": make_peft_adapter(out / "b", base_model=base, seed=2, r=4, target_modules=("q_proj", "k_proj", "v_proj")),
        "c": make_peft_adapter(out / "c", base_model=base, seed=3, r=2, target_modules=("o_proj", "down_proj")),
    }
    # Same weights as "a", another alpha: a different adapter (digest) sharing the weights file.
    dirs["a_alpha"] = _edited_copy(dirs["a"], out / "a_alpha", lora_alpha=32)
    dirs["dora"] = _edited_copy(dirs["a"], out / "dora", use_dora=True)
    dirs["corrupt_header"] = _copy(dirs["a"], out / "corrupt_header")
    weights = dirs["corrupt_header"] / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[9] = ord("!")  # inside the JSON header
    weights.write_bytes(bytes(data))
    dirs["no_weights"] = _copy(dirs["a"], out / "no_weights")
    (dirs["no_weights"] / "adapter_model.safetensors").unlink()
    return dirs


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edited_copy(src: Path, dst: Path, **changes: object) -> Path:
    _copy(src, dst)
    path = dst / "adapter_config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw, indent=2))
    return dst


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root with a digest of its content ("dir" for directories)."""
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        found[rel] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def stage_begin(adapter_dir: Path, adapter_id: str, chunk_size: int = 1 << 20, **overrides: object):
    """A StageBegin for a PEFT directory, as NodeClient.stage sends it to a node staging at ``chunk_size``."""
    weights = (Path(adapter_dir) / "adapter_model.safetensors").read_bytes()
    config = overrides.pop("config_json", None) or (Path(adapter_dir) / "adapter_config.json").read_bytes()
    return stage_begin_of(adapter_id, config, weights, chunk_size, **overrides)


def stage_begin_of(adapter_id: str, config_json: bytes, weights: bytes, chunk_size: int = 1 << 20, **overrides: object):
    """A StageBegin for a config and weights file given as bytes (see ``stage_begin``)."""
    from blake3 import blake3

    from adapter_fabric.store.digests import DIGEST_SCHEME, WEIGHTS_FILE, hash_bytes
    from adapter_fabric.v1 import fabric_pb2

    fields = {
        "adapter_id": adapter_id,
        "config_json": config_json,
        "safetensors_size": len(weights),
        "safetensors_blake3": blake3(weights).hexdigest(),
        "weights_root": hash_bytes(WEIGHTS_FILE, weights, chunk_size).root,
        "digest_scheme": DIGEST_SCHEME,
    }
    fields.update(overrides)
    return fabric_pb2.StageBegin(**fields)


def blake3_of(path: Path) -> str:
    """The whole-file BLAKE3 of a file (what NodeClient.stage keys an upload by)."""
    from adapter_fabric.store.digests import whole_file_blake3

    return whole_file_blake3(path)


def flip_byte(path: Path, offset: int) -> None:
    """Flip one bit of the byte at ``offset`` of a (read-only) blob (-1: the last byte, inside the last tensor)."""
    os.chmod(path, 0o644)
    offset = path.stat().st_size - 1 if offset == -1 else offset
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))
    os.chmod(path, 0o444)


def corrupt_behind_the_writer(data_path: Path, offset: int) -> None:
    """Flip a byte through another descriptor, as a stray writer (or a bad disk tool) would, until the ctime moves."""
    before = data_path.stat().st_ctime_ns
    with open(data_path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        for _ in range(200):  # a coarse-clock kernel may need a tick to pass before the ctime changes
            handle.seek(offset)
            handle.write(bytes([byte[0] ^ 0xFF]))
            handle.flush()
            if os.fstat(handle.fileno()).st_ctime_ns != before:
                return
            time.sleep(0.005)
    pytest.skip("the data file's ctime did not move after a write (filesystem without ctime updates)")
