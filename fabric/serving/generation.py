"""One Generate request run as short jobs on the model worker: start (ref + prefill), one job per decode step, finish.

Why jobs and not one call: a node runs model work on one worker thread, in
order. A whole generation as one job would hold that thread for its full
length, so a promote's commit (also a worker job) would wait behind it, and a
caller that went away could not stop it. As one job per step, a commit
queued meanwhile lands between two steps, and the request's coroutine stops
submitting steps as soon as its caller cancels or its deadline passes.

The ref on the slot is taken in ``start`` and dropped in ``finish``; a caller
submits ``finish`` to the same single worker after whatever it submitted
before (even when it was cancelled while a job was queued or running), so the
ref is always dropped, and never before the job that took it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adapter_fabric.errors import InvalidArgument
from adapter_fabric.serving.multi_lora import Decoding, MultiLoraModel
from adapter_fabric.serving.pool import ACTIVE


class Generation:
    """Greedy decoding of one sequence for one caller; not thread-safe (run every method on the one model worker)."""

    def __init__(
        self, model: MultiLoraModel, input_ids: Sequence[int], target: str | int | None, max_new_tokens: int, return_logits: bool, limit: int
    ) -> None:
        """Check every bound before any model work: ids, positions, and ``max_new_tokens`` against the node's ``limit``."""
        if not input_ids:
            raise InvalidArgument("Generate needs at least one input token id")
        if max_new_tokens > limit:
            raise InvalidArgument(f"max_new_tokens {max_new_tokens} is above this node's limit of {limit} (--max-new-tokens)")
        model.check_tokens(input_ids, max_new_tokens)
        self.model = model
        self.input_ids = list(input_ids)
        self.target = target
        self.max_new_tokens = max_new_tokens
        self.return_logits = return_logits
        #: the slot the sequence holds a ref on (-1: base model or no active adapter); None until ``start``
        self.resolved: int | None = None
        self.content_id = 0
        self.last_logits: list[float] = []
        self.output_ids: list[int] = []
        self._decoding: Decoding | None = None
        self._held = False

    def start(self) -> None:
        """Take the ref (prefill time) and compute the last logits if asked."""
        self.resolved = self.model.acquire(self.target)
        self._held = True
        row = None if self.resolved == ACTIVE else self.resolved
        self.content_id = self.model.adapter_id_for(row) if row is not None else 0
        ids = torch.tensor([self.input_ids])
        if self.return_logits:
            self.last_logits = self.model.forward(ids, [row])[0, -1].float().tolist()
        if self.max_new_tokens:
            self._decoding = Decoding(self.model, ids, self.resolved)

    @property
    def done(self) -> bool:
        return self._decoding is None or len(self.output_ids) >= self.max_new_tokens

    def step(self) -> None:
        """Decode one token."""
        assert self._decoding is not None
        self.output_ids.append(int(self._decoding.step()[0, 0]))

    def finish(self) -> None:
        """Drop the ref taken by ``start`` (a no-op if ``start`` never ran); safe to call twice."""
        held, self._held = self._held, False
        self._decoding = None
        if held and self.resolved is not None:
            self.model.release(self.resolved)
