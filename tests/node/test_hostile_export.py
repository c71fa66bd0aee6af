"""Issue 18, item 1: --export-dir never costs data.

Real node processes: an export directory that is the store, holds it, or lies
inside it stops the node at start with one line naming both; an operator's own
files in the export directory survive restarts, while the node's own entries
are kept in step with the store.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from adapter_fabric.client import NodeClient
from adapter_fabric.harness.cluster import LocalNode
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter
from tests.support.store import snapshot

pytestmark = pytest.mark.timeout(300)


def start_fails(node: LocalNode) -> list[str]:
    """Launch ``node``, which must exit before listening; its stderr lines."""
    node.launch()
    assert node.process is not None
    try:
        code = node.process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        node.stop()
        pytest.fail("the node started")
    assert code != 0
    return [line for line in Path(node.log_path).read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_export_dir_overlapping_the_store_is_refused_at_start(tmp_path, where):
    store = tmp_path / "data" / "store"
    export = {"same": store, "parent": store.parent, "inside": store / "exports"}[where]
    with LocalNode(store, model="none"):  # a store with something in it first
        pass
    before = snapshot(store)
    lines = start_fails(LocalNode(store, model="none", extra_args=["--export-dir", str(export)]))
    refusal = [line for line in lines if "--export-dir" in line]
    assert len(refusal) == 1 and str(export) in refusal[0] and str(store) in refusal[0], lines
    assert not any("Traceback" in line for line in lines), lines
    assert snapshot(store) == before  # nothing set aside, nothing deleted


def test_operator_files_in_the_export_dir_survive_restarts(tmp_path):
    adapter = make_peft_adapter(tmp_path / "adapter", base_model=build_tiny_model(), r=4, target_modules=["q_proj", "v_proj"], seed=1)
    export = tmp_path / "export"
    mine = {  # an operator's own things, some of them named like an id, one like the node's temp names
        export / "notes" / "todo.txt": b"keep me",
        export / "team%2Fold" / "adapter_model.safetensors.bak": b"a backup",
        export / "%mine" / "x": b"percent",
        export / "readme.txt": b"a file, not a directory",
    }
    for path, data in mine.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    store = tmp_path / "store"
    node = LocalNode(store, model="none", extra_args=["--export-dir", str(export)])
    with node:
        with NodeClient(node.address) as client:
            client.stage(adapter, "team/a")
            client.stage(adapter, "team/gone")
            client.unstage("team/gone")
    for _ in range(2):  # the case lost everything by the second restart
        with node:
            pass
    for path, data in mine.items():
        assert path.read_bytes() == data, path
    assert (export / "team%2Fa" / "adapter_model.safetensors").exists()
    assert not (export / "team%2Fgone").exists()
