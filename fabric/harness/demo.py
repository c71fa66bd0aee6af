"""``fabric demo``: a local 3-node cluster on the tiny model, end to end.

Three real node processes (2 slots each) on loopback. Three adapters are made
with PEFT's ``save_pretrained`` and all three staged on node 1; one is promoted
on node 2 from node 1 and on node 3 from node 2 (a chain: a node that pulled an
adapter serves it); the other two are promoted on node 3 until its pool evicts. Outputs over the
wire are checked against PEFT's own ``PeftModel`` for the same adapters.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from adapter_fabric.client.node_client import NodeClient
from adapter_fabric.harness.cluster import LocalCluster
from adapter_fabric.serving.tiny import build_tiny_model, make_peft_adapter

PROMPT = [1, 17, 42, 99, 5, 23]
TOLERANCE = 1e-4

ADAPTERS: dict[str, dict[str, Any]] = {
    "support-v1": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], seed=11),
    "sql-v2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], use_rslora=True, seed=12),
    "legal-v1": dict(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj", "down_proj"], rank_pattern={"down_proj": 4}, seed=13),
}


def _reference_logits(adapter_dir: Path | None) -> torch.Tensor:
    """Last-position logits of PEFT's own model (or the bare base model)."""
    model = build_tiny_model()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    with torch.no_grad():
        return model(torch.tensor([PROMPT])).logits[0, -1]


def _check(label: str, got: list[float], adapter_dir: Path | None) -> bool:
    diff = (torch.tensor(got) - _reference_logits(adapter_dir)).abs().max().item()
    ok = diff <= TOLERANCE
    print(f"   {label:<36} max |logits - PEFT| = {diff:.2e}  {'OK' if ok else 'MISMATCH'}")
    return ok


def run_demo(workdir: str | None = None, keep: bool = False) -> int:
    root = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="fabric-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers deprecation notices, not ours
    removed = not keep and workdir is None
    print(f"adapter-fabric demo (work directory {root}{', removed at the end: --keep keeps it' if removed else ''})")

    print("1. making three LoRA adapters with PEFT save_pretrained on the built-in tiny Llama")
    base = build_tiny_model()
    dirs = {name: make_peft_adapter(root / "adapters" / name, base_model=base, **kw) for name, kw in ADAPTERS.items()}
    for name, kw in ADAPTERS.items():
        print(f"   {name:<11} r={kw['r']:<2} alpha={kw['lora_alpha']:<3} targets={','.join(kw['target_modules'])}")

    print("2. starting 3 node processes on loopback (tiny model, 2 slots each; a mesh: --homes 0)")
    # A mesh, not a fleet with placement (the default): three nodes would be every adapter's homes, and the Stage below would
    # already have copied each adapter to all three; here each promote moves the bytes from the node it names.
    cluster = LocalCluster(root / "cluster", 3, slots=2, extra_args=["--homes", "0"])
    all_ok = True
    try:
        cluster.start()
        n1, n2, n3 = (NodeClient(node.address) for node in cluster.nodes)
        for i, node in enumerate(cluster.nodes, 1):
            print(f"   node{i} {node.address} (pid {node.pid})")

        print("3. staging the three adapters on node1")
        for name in ADAPTERS:
            reply = n1.stage(dirs[name], name)
            print(f"   {name:<11} digest {reply.digest[:16]}…  content id {reply.content_id:#018x}")

        print("4. promoting across the cluster")

        def promote(client: NodeClient, label: str, adapter: str, peer: str) -> str:
            t0 = time.perf_counter()
            r = client.promote(adapter, peer=peer, name=adapter)
            evicted = f", evicted {r.evicted_name}" if r.evicted_name else ""
            print(f"   {label}: {adapter} -> slot {r.slot}{evicted}  ({r.bytes_transferred} B of weights from {r.source_peer or 'local store'}, {1e3 * (time.perf_counter() - t0):.0f} ms)")
            return r.evicted_name

        promote(n2, "node2 <- node1", "support-v1", cluster.nodes[0].address)
        promote(n3, "node3 <- node2", "support-v1", cluster.nodes[1].address)
        evicted = ""
        for name in ("sql-v2", "legal-v1"):
            evicted = promote(n3, "node3 <- node1", name, cluster.nodes[0].address) or evicted
        print(f"   node3's pool evicted {evicted!r} (least recently used)" if evicted else "   no eviction reported")
        all_ok &= evicted == "support-v1"

        print("5. generating over gRPC and checking against PEFT's PeftModel")
        all_ok &= _check("node3 base model", n3.generate(PROMPT, use_base=True, return_logits=True).last_logits, None)
        all_ok &= _check("node3 legal-v1", n3.generate(PROMPT, "legal-v1", return_logits=True).last_logits, dirs["legal-v1"])
        all_ok &= _check("node3 sql-v2", n3.generate(PROMPT, "sql-v2", return_logits=True).last_logits, dirs["sql-v2"])
        all_ok &= _check("node2 support-v1 (pulled from node1)", n2.generate(PROMPT, "support-v1", return_logits=True).last_logits, dirs["support-v1"])
        tokens = n3.generate(PROMPT, "legal-v1", max_new_tokens=8).output_ids
        print(f"   node3 legal-v1 greedy continuation of {PROMPT}: {tokens}")

        print("6. node3's slots")
        for s in n3.list().slots:
            print(f"   [{s.slot}] (empty)" if s.empty else f"   [{s.slot}] {s.name:<11} content id {s.content_id:#018x} refs={s.ref_count}{' active' if s.active else ''}")
        for client in (n1, n2, n3):
            client.close()
    finally:
        cluster.stop()
        if removed:
            shutil.rmtree(root, ignore_errors=True)
    print(f"work directory {root} {'removed' if removed else 'kept'}")
    print(f"{'all checks passed' if all_ok else 'SOME CHECKS FAILED'} in {time.perf_counter() - started:.1f} s")
    return 0 if all_ok else 1
