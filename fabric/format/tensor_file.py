"""A safetensors file's bytes for staging: a private read or a memory map, and the dtypes and checks on them.

``safetensors.torch.load`` copies every tensor out of the file's bytes; staging
then copies them again into a slot row. Here the bytes stay in one buffer (a
private read of an untrusted file, or a memory map of an immutable store
blob) and staging (``adapter_fabric.serving.row_sink``) copies each tensor straight
from it into the row, so staging is the only copy.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

from adapter_fabric.errors import IntegrityError

#: safetensors dtype names of the float types a LoRA adapter may hold (see adapter_tensors.FLOAT_DTYPES)
TORCH_DTYPES: dict[str, torch.dtype] = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


def read_private(path: Path) -> bytearray:
    """The whole file in a private, writable buffer (a snapshot: later writes to the file do not reach it)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        buf = bytearray(size)
        view, got = memoryview(buf), 0
        while got < size:
            n = f.readinto(view[got:])
            if not n:
                raise IntegrityError(f"{path}: the file shrank while being read ({got} of {size} bytes)")
            got += n
    return buf


def map_immutable(path: Path, expected_size: int) -> mmap.mmap:
    """A memory map of a file nobody writes (a committed store blob, mode 0444), checked against its expected size.

    ``ACCESS_COPY`` gives a writable private mapping so ``torch.frombuffer`` takes it without a warning;
    nothing writes to it, so no page is ever copied.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != expected_size:
            raise IntegrityError(f"{path}: {size} bytes on disk, its verified manifest says {expected_size}; re-stage or re-pull it")
        if size == 0:
            raise IntegrityError(f"{path}: the file is empty")
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)


def has_non_finite(row: torch.Tensor) -> bool:
    """Whether a float tensor holds NaN or +-inf: one ``aminmax`` pass (both propagate NaN).

    Much cheaper than ``isfinite(...).all()`` or a float32 sum on bf16/fp16 rows on CPU
    (84 MB bf16: ~8 ms against ~100-190 ms).
    """
    low, high = torch.aminmax(row)
    return not (bool(torch.isfinite(low)) and bool(torch.isfinite(high)))
