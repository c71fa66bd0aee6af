"""Issue 32 with origins (issue 31): eight real node processes with --homes 3 and one --origin (a directory, ``file://``).

Asked at once, the eight download an adapter held only at the origin once in all: the id's first live home fetches it
(the others' asks join its one fetch), its other homes and the askers pull it from there. Counted from every node's
own ``fabric_origin_fetches_total``.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from adapter_fabric.harness.cluster import LocalNode, free_port, start_all, stop_all
from adapter_fabric.transport.placement import Fleet

from tests.support.scrape import scrape
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NODES = 8
K = 3


def _origin_fetches(nodes: list[LocalNode], origin: str) -> float:
    return sum(
        value for node in nodes for (name, labels), value in scrape(node).items()
        if name == "fabric_origin_fetches_total" and dict(labels) == {"origin": origin, "outcome": "ok"}
    )  # fmt: skip


def test_eight_nodes_asked_at_once_download_an_origin_only_adapter_once(tmp_path: Path, store_adapters) -> None:
    origin_dir = tmp_path / "origin"
    (origin_dir / "team-a" / "hot").mkdir(parents=True)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copyfile(store_adapters["a"] / name, origin_dir / "team-a" / "hot" / name)
    origin = f"file://{origin_dir}"
    ports = [free_port() for _ in range(NODES)]
    addresses = [f"127.0.0.1:{p}" for p in ports]
    nodes = [
        LocalNode(
            tmp_path / f"node{i}", model="none", port=port, peers=[a for a in addresses if a != addresses[i]],
            extra_args=["--homes", str(K), "--origin", origin, "--metrics-listen", "127.0.0.1:0"],
        )  # fmt: skip
        for i, port in enumerate(ports)
    ]
    start_all(nodes)
    try:
        clients = [node.client() for node in nodes]
        with ThreadPoolExecutor(NODES) as pool:
            replies = list(pool.map(lambda client: client.pull("team-a/hot"), clients))
        for client in clients:
            client.close()
        assert len({r.digest for r in replies}) == 1
        assert _origin_fetches(nodes, origin) == 1  # one download from the origin, however many asked at once
        homes = Fleet.of(addresses).homes("team-a/hot", K)
        by_address = {n.address: n for n in nodes}

        def held(node: LocalNode) -> bool:
            with node.client() as client:
                return any(a.adapter_id == "team-a/hot" for a in client.list().staged)

        wait_for(lambda: all(held(by_address[h]) for h in homes), what="every home to hold it")
        assert _origin_fetches(nodes, origin) == 1
    finally:
        stop_all(nodes)
