"""Issue 33: the QuotaExceeded text an operator reads: grammatical, sizes in store-status's units, hints that apply."""

from __future__ import annotations

import pytest

from adapter_fabric.errors import QuotaExceeded
from adapter_fabric.rpc.status import public_message
from adapter_fabric.store.eviction import ENGINE, ENGINE_UNKNOWN, KEPT, LAST_COPY, Candidate, choose_victims
from adapter_fabric.store.quota import quota_exceeded

KIB = 1 << 10


def refused(*held: tuple[str, int]) -> str:
    candidates = [Candidate(f"d{i}", (f"id{i}",), 50 * KIB, i, reason) for i, (reason, count) in enumerate(held) for _ in range(count)]
    with pytest.raises(QuotaExceeded) as caught:
        choose_victims(candidates, 80 * KIB, 150 * KIB, 200 * KIB, 0.9, "downloading 'team-a/x'")
    return str(caught.value)


def test_the_eviction_refusal_reads_as_a_sentence_in_store_status_units() -> None:
    text = refused((LAST_COPY, 1), (KEPT, 2))
    assert text.startswith("downloading 'team-a/x' needs 80 KiB, and the store holds 150 KiB of its 200 KiB limit (30 KiB over)"), text
    assert "1 adapter is the last complete copy among the known peers: a durable peer (--when-full refuse)" in text
    assert "2 adapters are kept by an operator: fabric keep NODE --id ID --unkeep lets one go" in text
    assert "held are" not in text and "-byte limit" not in text and "204800" not in text


def test_an_engines_hold_is_not_an_operators_unkeep_or_unstage() -> None:
    text = refused((ENGINE.format("127.0.0.1:8000"), 1), (ENGINE_UNKNOWN.format("127.0.0.1:8001"), 1))
    assert "registered by engine 127.0.0.1:8000 (its GET /v1/models names it): unload it in the engine first" in text
    assert "has not answered GET /v1/models (what it may read is unknown): once the engine answers" in text
    assert "unkeep" not in text and "unstage" not in text


def test_the_advice_sent_with_it_fits_a_full_store_not_a_busy_pool() -> None:
    message = public_message(quota_exceeded(80 * KIB, 150 * KIB, 200 * KIB, "uploading 'a'"))
    assert message.endswith("unstage adapters (fabric unstage) or raise --max-store-bytes (retry once there is room under the limit)"), message
    assert "running sequence" not in message
