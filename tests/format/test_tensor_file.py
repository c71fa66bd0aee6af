"""``has_non_finite``: NaN and +-inf found in every float dtype a pool may hold, on both of its paths.

Rows under ``SINGLE_THREAD_CHECK_BYTES`` are checked by numpy on the calling thread (``bits_non_finite``: min/max of
32/64-bit floats, two integer max passes over 16-bit ones); larger rows by torch's ``aminmax``. ``bits_non_finite``
is held to ``torch.isfinite`` on every 16-bit pattern: a row sink checks each piece of a chunk with it.
"""

from __future__ import annotations

import pytest
import torch

from adapter_fabric.format import tensor_file
from adapter_fabric.format.tensor_file import bits_non_finite, has_non_finite, host_array

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
BLOCK = 1 << 16  # positions either side of a 64 Ki-element boundary


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), -float("nan")])
@pytest.mark.parametrize("where", [0, BLOCK - 1, BLOCK, 2 * BLOCK + 7, -1])
def test_a_non_finite_value_anywhere_is_found(dtype: torch.dtype, bad: float, where: int) -> None:
    row = torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(1)).to(dtype) * 1000
    assert not has_non_finite(row)
    row[where] = bad
    assert has_non_finite(row)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_largest_finite_values_and_zeros_are_finite(dtype: torch.dtype) -> None:
    info = torch.finfo(dtype)
    row = torch.tensor([info.max, -info.max, info.tiny, -info.tiny, 0.0, -0.0, info.eps], dtype=dtype)
    assert not has_non_finite(row)
    assert not has_non_finite(torch.zeros(0, dtype=dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_both_paths_agree(monkeypatch, dtype: torch.dtype) -> None:
    """The torch path (rows at or above the bound) gives the same answers as the numpy path."""
    row = torch.randn(BLOCK + 3).to(dtype)
    for limit in (1 << 40, 0):  # numpy on this thread, then aminmax for everything
        monkeypatch.setattr(tensor_file, "SINGLE_THREAD_CHECK_BYTES", limit)
        assert not has_non_finite(row)
        with_inf = torch.cat([row, torch.tensor([float("inf")], dtype=dtype)])
        assert has_non_finite(with_inf)
        assert has_non_finite(with_inf.view(-1, 1).expand(-1, 2).t())  # a non-contiguous view: aminmax whatever its size


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_bit_test_agrees_with_isfinite_on_every_16_bit_pattern(dtype: torch.dtype) -> None:
    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    values = patterns.view(dtype)
    finite = torch.isfinite(values)
    bits = host_array(values)
    wrong = [hex(int(p) & 0xFFFF) for p, ok in zip(patterns, finite) if bits_non_finite(bits[int(p) + (1 << 15) : int(p) + (1 << 15) + 1], dtype) == bool(ok)]
    assert not wrong, f"{len(wrong)} patterns misjudged, e.g. {wrong[:5]}"
    assert bits_non_finite(bits, dtype) and not bits_non_finite(host_array(values[finite]), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_bit_test_finds_one_non_finite_value_among_finite_ones(dtype: torch.dtype) -> None:
    row = torch.randn(1000, generator=torch.Generator().manual_seed(2)).to(dtype)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for where in (0, 517, 999):
            with_bad = row.clone()
            with_bad[where] = bad
            assert bits_non_finite(host_array(with_bad), dtype)
    assert not bits_non_finite(host_array(row), dtype)
    assert not bits_non_finite(host_array(row[:0]), dtype)
