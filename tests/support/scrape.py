"""A node's plain-HTTP endpoint read as a client would: a GET, and /metrics parsed into samples."""

from __future__ import annotations

import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from adapter_fabric.harness.cluster import LocalNode


def http_get(address: str, path: str) -> tuple[int, str]:
    """``(status, body)`` of ``GET http://address/path`` (an error status is returned, not raised)."""
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=30) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def scrape(node: LocalNode) -> dict[tuple[str, frozenset], float]:
    """Every sample of the node's /metrics: (name, labels) -> value."""
    status, text = http_get(node.metrics_address, "/metrics")
    assert status == 200
    return {(s.name, frozenset(s.labels.items())): s.value for family in text_string_to_metric_families(text) for s in family.samples}
