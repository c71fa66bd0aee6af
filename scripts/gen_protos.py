#!/usr/bin/env python3
"""Regenerate the Python code under fabric/v1/ from protos/ (the one way to do it).

    python scripts/gen_protos.py

tests/project/test_protos.py fails when the committed code no longer matches the .proto.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


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
        init = package_dir / "__init__.py"
        if not init.exists():
            init.write_text('"""Generated from protos/ by scripts/gen_protos.py; do not edit."""\n')


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print("generated:", ", ".join(str(p.relative_to(PROTO_ROOT)) for p in proto_files()))
