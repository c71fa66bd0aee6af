"""Library errors <-> gRPC status codes (one table), and the PEFT fields a promote may carry."""

from __future__ import annotations

import grpc
import pytest

from adapter_fabric import errors
from adapter_fabric.format.config import PeftAdapterConfig
from adapter_fabric.format.peft_fields import check_agrees, peft_fields_of
from adapter_fabric.rpc.status import ERROR_DETAIL_KEY, error_detail, error_from_rpc, status_code_for
from adapter_fabric.v1 import fabric_pb2

EXPECTED = {
    errors.AdapterNotFound: grpc.StatusCode.NOT_FOUND,
    errors.PoolFull: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.QuotaExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.PinLimitReached: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.SlotBusy: grpc.StatusCode.FAILED_PRECONDITION,
    errors.IncompatibleAdapter: grpc.StatusCode.FAILED_PRECONDITION,
    errors.AdaptersUnsupported: grpc.StatusCode.FAILED_PRECONDITION,
    errors.StoreMissing: grpc.StatusCode.FAILED_PRECONDITION,
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidAdapterId: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidConfig: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidHeader: grpc.StatusCode.INVALID_ARGUMENT,
    errors.InvalidTensors: grpc.StatusCode.INVALID_ARGUMENT,
    errors.ConfigMismatch: grpc.StatusCode.INVALID_ARGUMENT,
    errors.IntegrityError: grpc.StatusCode.DATA_LOSS,
    errors.Busy: grpc.StatusCode.ABORTED,
    errors.Untrusted: grpc.StatusCode.PERMISSION_DENIED,
    errors.PeerUnavailable: grpc.StatusCode.UNAVAILABLE,
    errors.DeadlineExceeded: grpc.StatusCode.DEADLINE_EXCEEDED,  # a PeerUnavailable, with a code of its own
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


def _every_error_type() -> set[type]:
    found, todo = set(), [errors.FabricError]
    while todo:
        for sub in todo.pop().__subclasses__():
            found.add(sub)
            todo.append(sub)
    return {t for t in found if t.__module__ == "adapter_fabric.errors"}


@pytest.mark.parametrize("kind, code", EXPECTED.items(), ids=lambda v: getattr(v, "__name__", str(v)))
def test_each_error_has_its_code(kind, code) -> None:
    assert status_code_for(kind("x")) == code


def test_no_error_type_falls_through_to_internal() -> None:
    for kind in _every_error_type():
        assert status_code_for(kind("x")) != grpc.StatusCode.INTERNAL, kind.__name__


def test_only_pool_full_quota_busy_peers_and_origins_are_retryable() -> None:
    retryable = {kind for kind in _every_error_type() if kind.retryable}
    # a deadline (a node, or an origin, that did not answer in time) may pass too: a kind of PeerUnavailable (issue 33)
    assert retryable == {errors.PoolFull, errors.QuotaExceeded, errors.StoreFull, errors.Busy, errors.PeerUnavailable, errors.OriginUnavailable,
                         errors.DeadlineExceeded, errors.OriginTooSlow}
    assert not errors.PinLimitReached.retryable  # only an operator's unpin frees a pin


def test_every_error_type_is_importable_from_fabric() -> None:
    import adapter_fabric as fabric

    for kind in _every_error_type() | {errors.FabricError}:
        assert getattr(fabric, kind.__name__) is kind and kind.__name__ in fabric.__all__, kind.__name__


class _FakeRpcError(grpc.RpcError):
    """A failed call as a client sees it (the shape grpc's own errors have)."""

    def __init__(self, code, details, trailing=()):
        self._code, self._details, self._trailing = code, details, trailing

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._trailing


def test_clients_rebuild_the_library_error_from_the_detail() -> None:
    sent = errors.PoolFull("every slot is busy")
    rpc = _FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", ((ERROR_DETAIL_KEY, error_detail(sent, str(sent))),))
    rebuilt = error_from_rpc(rpc)
    assert type(rebuilt) is errors.PoolFull and str(rebuilt) == "every slot is busy"


@pytest.mark.parametrize("bound", sorted(errors.NAMED_BOUNDS))
def test_a_refusal_names_its_bound_across_the_wire_and_a_bound_not_named_here_reads_as_none(bound) -> None:
    def across(detail: bytes) -> errors.FabricError:
        return error_from_rpc(_FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "x", ((ERROR_DETAIL_KEY, detail),)))

    rebuilt = across(error_detail(errors.QuotaExceeded("busy", bound), "busy"))
    assert type(rebuilt) is errors.QuotaExceeded and rebuilt.bound == bound
    assert across(error_detail(errors.StoreFull("full"), "full")).bound == ""  # not one a peer acts on
    odd = fabric_pb2.ErrorDetail(kind="QuotaExceeded", message="busy", bound=bound + "x" * 1000).SerializeToString()
    assert across(odd).bound == ""  # a peer's unknown (or newer) bound: as an older node's silence
    older = fabric_pb2.ErrorDetail(kind="QuotaExceeded", message="busy").SerializeToString()
    assert across(older).bound == ""


def test_a_status_without_detail_still_maps() -> None:
    assert isinstance(error_from_rpc(_FakeRpcError(grpc.StatusCode.UNAVAILABLE, "connection refused"), peer="h:1"), errors.PeerUnavailable)
    assert isinstance(error_from_rpc(_FakeRpcError(grpc.StatusCode.NOT_FOUND, "gone")), errors.AdapterNotFound)
    other = error_from_rpc(_FakeRpcError(grpc.StatusCode.INTERNAL, "boom"), peer="h:1")
    assert type(other) is errors.FabricError and "INTERNAL" in str(other) and "h:1" in str(other)


def test_a_forged_detail_kind_cannot_pick_an_arbitrary_class() -> None:
    forged = fabric_pb2.ErrorDetail(kind="Exception", message="x").SerializeToString()
    rebuilt = error_from_rpc(_FakeRpcError(grpc.StatusCode.NOT_FOUND, "gone", ((ERROR_DETAIL_KEY, forged),)))
    assert isinstance(rebuilt, errors.AdapterNotFound)


# ---------------------------------------------------------------- PEFT fields

STAGED = PeftAdapterConfig(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj"), rank_pattern={"v_proj": 4}, alpha_pattern={"v_proj": 2.0})


def test_unset_fields_mean_whatever_was_staged() -> None:
    check_agrees(None, STAGED, "a")
    check_agrees(fabric_pb2.PeftFields(), STAGED, "a")
    check_agrees(peft_fields_of(STAGED), STAGED, "a")


@pytest.mark.parametrize(
    "fields, message",
    [
        (fabric_pb2.PeftFields(r=4), r"r: asked 4, staged 8"),
        (fabric_pb2.PeftFields(lora_alpha=32), r"lora_alpha: asked 32, staged 16"),
        (fabric_pb2.PeftFields(use_rslora=True), r"use_rslora: asked True, staged False"),
        (fabric_pb2.PeftFields(target_modules=["q_proj"]), r"target_modules: asked \['q_proj'\]"),
        (fabric_pb2.PeftFields(rank_pattern={"v_proj": 2}), r"rank_pattern: asked \{'v_proj': 2\}"),
        (fabric_pb2.PeftFields(alpha_pattern={"v_proj": 3.0}), r"alpha_pattern: asked \{'v_proj': 3.0\}"),
    ],
)
def test_each_disagreement_is_named(fields, message) -> None:
    with pytest.raises(errors.ConfigMismatch, match=message):
        check_agrees(fields, STAGED, "team/a")


def test_explicit_false_rslora_is_checked_not_ignored() -> None:
    rslora = PeftAdapterConfig(r=8, lora_alpha=16, target_modules=("q_proj",), use_rslora=True)
    with pytest.raises(errors.ConfigMismatch, match="use_rslora"):
        check_agrees(fabric_pb2.PeftFields(use_rslora=False), rslora, "a")
