"""The store's manifest cache is bounded: the least recently used go first, a used one stays."""

from __future__ import annotations

from dataclasses import dataclass

from adapter_fabric.store.manifest_cache import ManifestCache


@dataclass(frozen=True)
class Named:
    digest: str


def test_past_its_capacity_the_least_recently_used_manifest_goes() -> None:
    cache = ManifestCache(capacity=3)
    for digest in ("a", "b", "c"):
        cache.put(Named(digest))  # type: ignore[arg-type]
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put(Named("d"))  # type: ignore[arg-type]
    assert len(cache) == 3
    assert cache.get("b") is None and all(cache.get(d) is not None for d in ("a", "c", "d"))
    cache.drop("a")
    assert cache.get("a") is None and len(cache) == 2
