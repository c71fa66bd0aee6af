"""Staging a slot row while a pull receives it: each verified chunk lands in the store file and in the row.

A promote from a peer used to pull the whole file, commit it, then map the
blob and stage the slot row from it (``PoolAdapters.prepare_verified``): one
more pass over the bytes after the last chunk arrived. A ``RowSink`` is
attached to the pull's partial download instead (``PartialDownload.attach``):
every chunk, once verified and written, is also copied from the same buffer
into the host row, at the place of each tensor piece it carries (the row
keeps PEFT's layouts, so a full-rank piece is one contiguous copy; below
``max_rank``, lora_B's rows of ``r`` land in rows of ``max_rank``). When the
pull commits, the row is complete and the promote is the slot commit alone.

The row is laid out by ``SlotPool.blank_row`` (everything the adapter does
not write is zero: invariant 4), so only tensor bytes are copied here.
Chunks arrive on several worker threads at once; they write disjoint parts
of the row, and only the byte count is shared (under a lock).

A sink fed chunks is only made when every tensor starts at a multiple of
its element size in the file (safetensors writers align them), so a chunk
boundary never splits an element; otherwise ``RowSink.build`` answers None
and the promote stages from the committed blob. Fed a whole file as one
chunk (``chunk_size=None``: a directory or a blob already at hand), a sink
is how every adapter is staged: a numpy copy per tensor piece, no tensor
objects in between.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from adapter_fabric.errors import InvalidArgument, InvalidTensors
from adapter_fabric.format.adapter_tensors import LoraPair
from adapter_fabric.format.safetensors_index import SafetensorsIndex
from adapter_fabric.format.tensor_file import TORCH_DTYPES, bits_non_finite, has_non_finite, host_array
from adapter_fabric.serving.pool import SlotPool
from adapter_fabric.serving.slot_records import StagedAdapter


@dataclass(frozen=True)
class _Piece:
    """One tensor's bytes in the file and where they go in the row."""

    start: int  # file offset of its first byte
    end: int
    name: str
    dtype: torch.dtype
    offset: int  # row element where the tensor's region starts (A, or B)
    rank: int
    width: int  # elements per stored row: in_features for lora_A, the rank for lora_B
    padded: bool  # lora_B below max_rank: its rows of ``rank`` land in rows of max_rank


class RowSink:
    """A host slot row filled from a pull's verified chunks; ``finish`` hands it over as a ``StagedAdapter``."""

    def __init__(self, pool: SlotPool, pieces: list[_Piece], staged: StagedAdapter, chunk_size: int | None, digest: str) -> None:
        self._pool = pool
        self._chunk_size = chunk_size
        self._digest = digest
        self._pieces = pieces
        self._starts = [p.start for p in pieces]
        self._staged: StagedAdapter | None = staged
        self._row_tensor, _ = staged.buffers()  # the row, as long as this sink holds it (``finish`` hands it over)
        self._row = host_array(self._row_tensor)  # integer view of the row's bytes: numpy copies, one thread, no dtype conversion
        self._expected = sum(p.end - p.start for p in pieces)
        self._landed = 0
        self._lock = threading.Lock()
        # Fed chunks, a chunk's tensor bytes are checked for non-finite values as they land, while the chunk is in cache
        # (two integer max passes per run of pieces end to end): the whole-row scan after the last byte cost ~16 ms of CPU
        # on two threads per 84 MB row, and its wall time followed the last chunk. Fed whole, ``finish`` scans the row
        # once (aminmax on the intra-op threads).
        self._non_finite = False

    @classmethod
    def build(
        cls, pool: SlotPool, index: SafetensorsIndex, pairs: Mapping[str, LoraPair], scalings: Mapping[str, float],
        chunk_size: int | None = None, digest: str = "",
    ) -> RowSink | None:
        """A sink for a weights file of header ``index``, its pairs already checked against the pool (``check_compatible``).

        ``chunk_size``: the chunks it will be fed (None: the whole file at once); None is answered when a chunk
        boundary could split an element. ``digest``: the adapter's, for ``digest`` and messages.
        """
        base = index.data_offset
        pieces = []
        for module, pair in pairs.items():
            span = pool.span(module)
            for info, offset, width, padded in ((pair.a, span.a_off, pair.in_features, False), (pair.b, span.b_off, pair.rank, pair.rank < pool.max_rank)):
                dtype = TORCH_DTYPES[info.dtype]
                if chunk_size and ((base + info.begin) % dtype.itemsize or chunk_size % dtype.itemsize):
                    return None  # a chunk boundary could split an element
                pieces.append(_Piece(base + info.begin, base + info.end, info.name, dtype, offset, pair.rank, width, padded))
        pieces.sort(key=lambda p: p.start)
        staged = pool.blank_row({m: p.rank for m, p in pairs.items()}, scalings)
        return cls(pool, pieces, staged, chunk_size, digest)

    # ------------------------------------------------------------ receiving

    def add(self, index: int, data: bytes | memoryview) -> None:
        """Copy the tensor bytes of verified chunk ``index`` into the row (called once per chunk, from any thread)."""
        begin = index * self._chunk_size if self._chunk_size else 0
        end = begin + len(data)
        landed = 0
        run = (0, 0)  # the chunk's bytes [lo, hi) of pieces end to end already in the pool's dtype: checked in one pass
        first = max(0, bisect.bisect_right(self._starts, begin) - 1)
        for piece in self._pieces[first:]:
            if piece.start >= end:
                break
            lo, hi = max(begin, piece.start) - begin, min(end, piece.end) - begin
            if lo < hi:
                src = self._source(piece, data, lo, hi - lo)
                self._place(piece, src, lo + begin - piece.start, hi - lo)
                landed += hi - lo
                if piece.dtype != self._pool.dtype:
                    self._check(src)  # converted: values past the pool dtype's range are inf only now
                elif lo == run[1]:
                    run = (run[0], hi)
                else:
                    self._check_run(data, run)
                    run = (lo, hi)
        self._check_run(data, run)
        with self._lock:
            self._landed += landed

    def _check_run(self, data: bytes | memoryview, run: tuple[int, int]) -> None:
        """Check the chunk's bytes ``run`` (pieces in the pool's dtype): one pass per chunk, not per piece (~500 per
        84 MB pull, each two numpy reductions and a GIL hand-off)."""
        lo, hi = run
        if hi > lo:
            self._check(np.frombuffer(data, dtype=self._row.dtype, count=(hi - lo) // self._row.itemsize, offset=lo))

    def _check(self, bits: np.ndarray) -> None:
        if self._chunk_size and not self._non_finite and bits_non_finite(bits, self._pool.dtype):
            self._non_finite = True  # only ever set: workers racing here agree

    def _place(self, piece: _Piece, src: np.ndarray, into: int, length: int) -> None:
        """``src``, ``length`` bytes of ``piece`` that sit ``into`` bytes into it, to their place in the row."""
        itemsize = piece.dtype.itemsize
        first, count = into // itemsize, length // itemsize
        if not piece.padded:  # lora_A [r, in], or lora_B [out, r] at max_rank: laid out in the row as in the file
            np.copyto(self._row[piece.offset + first : piece.offset + first + count], src)
            return
        # lora_B [out, r] into B [out, max_rank]: element e = o * r + j lands at row position (o, j).
        rank, stride = piece.rank, self._pool.max_rank
        o, j, k = first // rank, first % rank, 0
        if j:  # the end of a B row that started in the previous chunk
            take = min(rank - j, count)
            start = piece.offset + o * stride + j
            np.copyto(self._row[start : start + take], src[:take])
            k, o = take, o + 1
        whole = (count - k) // rank
        if whole:
            rows = self._row[piece.offset + o * stride : piece.offset + (o + whole) * stride].reshape(whole, stride)
            np.copyto(rows[:, :rank], src[k : k + whole * rank].reshape(whole, rank))
            k, o = k + whole * rank, o + whole
        if k < count:  # the start of a B row that ends in the next chunk
            start = piece.offset + o * stride
            np.copyto(self._row[start : start + count - k], src[k:count])

    def _source(self, piece: _Piece, data: bytes | memoryview, at: int, length: int) -> np.ndarray:
        """The piece's elements as the row's integer type (converted first when the file's dtype is not the pool's)."""
        if piece.dtype == self._pool.dtype:
            return np.frombuffer(data, dtype=self._row.dtype, count=length // piece.dtype.itemsize, offset=at)
        values = torch.frombuffer(bytearray(memoryview(data)[at : at + length]), dtype=piece.dtype).to(self._pool.dtype)
        return host_array(values)

    # ------------------------------------------------------------ handing over

    @property
    def digest(self) -> str:
        """The adapter digest whose chunks this row is staged from ("" when not given)."""
        return self._digest

    @property
    def complete(self) -> bool:
        """Every tensor byte has landed in the row."""
        with self._lock:
            return self._landed == self._expected

    def finish(self) -> StagedAdapter:
        """The complete row, checked for non-finite values (``InvalidTensors`` naming the tensor); the sink is spent."""
        if not self.complete or self._staged is None:
            raise InvalidArgument(
                f"the row of {self._digest or 'an adapter'} holds {self._landed} of {self._expected} tensor bytes: its pull did not finish"
                if not self.complete else f"the row of {self._digest or 'an adapter'} was handed over already"
            )
        non_finite = self._non_finite if self._chunk_size else has_non_finite(self._row_tensor)
        staged, self._staged = self._staged, None
        assert staged is not None
        if non_finite:
            message = self._non_finite_message(staged)
            self._pool.recycle(staged)
            raise InvalidTensors(message)
        return staged

    def abandon(self) -> None:
        """Give the row back to the pool (the pull failed, or the promote went another way)."""
        if self._staged is not None:
            self._pool.recycle(self._staged)
            self._staged = None

    def _non_finite_message(self, staged: StagedAdapter) -> str:
        row, _ = staged.buffers()
        for piece in self._pieces:
            stored = (piece.end - piece.start) // piece.dtype.itemsize  # elements of the tensor
            rows = stored // piece.width
            region = row[piece.offset : piece.offset + rows * (self._pool.max_rank if piece.padded else piece.width)]
            bad = int((~torch.isfinite(region)).sum())  # padding is zeros: it never counts
            if bad:
                return f"tensor {piece.name!r} holds {bad} non-finite value(s) in {self._pool.dtype}"
        return "the adapter holds non-finite values"
