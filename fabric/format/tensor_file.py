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

import numpy as np
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


def map_immutable(path: Path, expected_size: int, what: str) -> mmap.mmap:
    """A memory map of a file nobody writes (a committed store blob, mode 0444), checked against its expected size.

    ``what`` names the file in a refusal (an adapter and its file name: a store's blob path means nothing to a caller).
    ``ACCESS_COPY`` gives a writable private mapping so ``torch.frombuffer`` takes it without a warning;
    nothing writes to it, so no page is ever copied.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size != expected_size:
            raise IntegrityError(f"{what}: {size} bytes on disk, its verified manifest says {expected_size}; re-stage or re-pull it")
        if size == 0:
            raise IntegrityError(f"{what}: the file is empty")
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)


#: below this many bytes a CPU tensor is checked for non-finite values on the calling thread (numpy): torch's
#: ``aminmax`` splits it over the intra-op pool, which on loaded cores waited ~1-7 ms for its threads on a 4.7 MB row
#: (0.1-0.2 ms here); at 84 MB (Llama-3-8B, r=16, bf16) the pool's threads pay off
SINGLE_THREAD_CHECK_BYTES = 32 << 20
#: 16-bit floats by their bits (numpy has no bfloat16; its float16 min/max is ~100x slower than integer ops): a value
#: is non-finite when its exponent bits are all ones. As signed integers the positive ones are at least the mask; as
#: unsigned, the negative ones are at least the mask with the sign bit. Two integer ``max`` passes, no scratch.
_EXPONENT_MASKS = {torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
_FLOAT_VIEWS = {torch.float32: np.float32, torch.float64: np.float64}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def has_non_finite(row: torch.Tensor) -> bool:
    """Whether a float tensor holds NaN or +-inf.

    Under ``SINGLE_THREAD_CHECK_BYTES`` on CPU: numpy on this thread (``bits_non_finite``). Otherwise one ``aminmax``
    pass on the intra-op threads, much cheaper than ``isfinite(...).all()`` or a float32 sum on bf16/fp16 rows (84 MB
    bf16: ~8 ms against ~100-190 ms).
    """
    if row.device.type == "cpu" and row.numel() * row.element_size() < SINGLE_THREAD_CHECK_BYTES and row.is_contiguous():
        return bits_non_finite(host_array(row.reshape(-1)), row.dtype)
    low, high = torch.aminmax(row)
    return not (bool(torch.isfinite(low)) and bool(torch.isfinite(high)))


def host_array(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor's bytes as same-width integers (numpy has no bfloat16)."""
    return t.detach().view(_INT_OF_SIZE[t.element_size()]).numpy()


def bits_non_finite(bits: np.ndarray, dtype: torch.dtype) -> bool:
    """Whether ``bits`` (a 1-D integer array of ``dtype``'s width holding ``dtype`` values) holds NaN or +-inf.

    One thread, no scratch: a row sink calls it on each tensor piece of a chunk while the chunk is in cache.
    """
    if not bits.size:
        return False
    mask = _EXPONENT_MASKS.get(dtype)
    if mask is None:  # float32 / float64: numpy's SIMD min/max, both of which propagate NaN
        values = bits.view(_FLOAT_VIEWS[dtype])
        return not (np.isfinite(values.min()) and np.isfinite(values.max()))
    return bool(bits.view(np.int16).max() >= mask or bits.view(np.uint16).max() >= 0x8000 | mask)
