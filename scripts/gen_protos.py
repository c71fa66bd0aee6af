#!/usr/bin/env python3
"""Regenerate the Python code under fabric/v1/ from protos/ (the one way to do it).

    python scripts/gen_protos.py

The folder fabric/ installs as the import package adapter_fabric (setup.py), while the .proto keeps its path
fabric/v1/fabric.proto and its package fabric.v1 (the wire names: /fabric.v1.Fabric/Stage). protoc names the
generated modules after the path, so their module names and imports are moved under adapter_fabric here.

tests/project/test_protos.py fails when the committed code no longer matches the .proto.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
#: the import package the folder fabric/ installs as (setup.py FOLDERS)
IMPORT_PACKAGE = "adapter_fabric"
#: the folder name where protoc wrote it as a module name: a generated module's own name, and the imports of one
GENERATED_NAME = re.compile(r"(?<=['\"])fabric(?=\.v1\.\w+_pb2['\"])|(?<=^from )fabric(?=\.v1 import )", re.M)


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def move_imports(path: Path) -> None:
    """Name a generated module (and its imports) under the import package, not the proto's folder."""
    path.write_text(GENERATED_NAME.sub(IMPORT_PACKAGE, path.read_text()))


def generate(out_dir: Path = ROOT) -> None:
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    for proto in proto_files():
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            str(proto.relative_to(PROTO_ROOT)),
        ]
        if protoc.main(args) != 0:
            raise SystemExit(f"protoc failed on {proto}")
        package_dir = out_dir / proto.relative_to(PROTO_ROOT).parent
        for generated in package_dir.glob(f"{proto.stem}_pb2*.py*"):
            move_imports(generated)
        init = package_dir / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated from protos/ by scripts/gen_protos.py; do not edit."""\n')


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print("generated:", ", ".join(str(p.relative_to(PROTO_ROOT)) for p in proto_files()))
