"""The committed generated code must match protos/ (run scripts/gen_protos.py after editing a .proto)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from google.protobuf import descriptor_pb2

from tests.support import ROOT


def _load_gen_script():
    spec = importlib.util.spec_from_file_location("gen_protos", ROOT / "scripts" / "gen_protos.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _drop_json_names(file_proto: descriptor_pb2.FileDescriptorProto) -> None:
    def visit(messages):
        for message in messages:
            for field in message.field:
                field.ClearField("json_name")
            visit(message.nested_type)

    visit(file_proto.message_type)


def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    """Compares descriptors, not text, so a newer protoc's cosmetic changes do not fail CI."""
    from grpc_tools import protoc

    gen = _load_gen_script()
    from adapter_fabric.v1 import fabric_pb2

    for proto in gen.proto_files():
        out = tmp_path / "set.pb"
        rc = protoc.main(["protoc", f"-I{gen.PROTO_ROOT}", f"--descriptor_set_out={out}", str(proto.relative_to(gen.PROTO_ROOT))])
        assert rc == 0
        fresh = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
        _drop_json_names(fresh)  # descriptor sets carry them, generated code does not
        committed = descriptor_pb2.FileDescriptorProto.FromString(fabric_pb2.DESCRIPTOR.serialized_pb)
        assert committed == fresh, f"{proto.name}: generated code is stale; run python scripts/gen_protos.py"


def test_service_lists_every_rpc() -> None:
    from adapter_fabric.v1 import fabric_pb2

    service = fabric_pb2.DESCRIPTOR.services_by_name["Fabric"]
    names = {m.name for m in service.methods}
    assert {"Stage", "GetManifest", "Fetch", "ListAdapters", "Promote", "SetActive", "Unstage", "Generate"} <= names
    assert service.methods_by_name["Stage"].client_streaming
    assert service.methods_by_name["Fetch"].server_streaming
