"""Metric definitions (``adapter_fabric.observability.metrics``): labels stay bounded, names are unique and documented."""

from __future__ import annotations

from adapter_fabric.observability.metrics import OTHER_PEER, catalog, peer_label


def test_peer_labels_are_bounded_to_known_peers() -> None:
    assert peer_label("10.0.0.1:50051", ["10.0.0.1:50051"]) == "10.0.0.1:50051"
    assert peer_label("203.0.113.9:4444", ["10.0.0.1:50051"]) == OTHER_PEER == "other"


def test_every_metric_has_one_name_a_kind_and_a_help_text() -> None:
    metrics = catalog()
    names = [m.name for m in metrics]
    assert len(names) == len(set(names)) and all(n.startswith("fabric_") for n in names)
    assert all(m.help for m in metrics)
