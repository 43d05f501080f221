"""Which micro-batch's backward comes next, from the shape of megatron's pipeline schedules.

All three schedules of megatron-core 0.16-0.19 (no pipelining, 1F1B, interleaved 1F1B) run,
on one rank, ``W`` warm-up forwards, then ``T - W`` pairs "forward, then backward", then the ``W``
remaining backwards, where ``T`` is the number of (model chunk, micro-batch) forwards of the
step. Backwards of one model chunk run in the order of its forwards. Knowing ``W`` and the
order of backwards is enough to say, right after a forward or a backward finishes, whose
backward is next, so the offloader can start reading it back while the pipeline communicates
(``begin_backward``), rather than when the backward itself starts.

The prediction is a hint: a wrong one costs an early read, never a wrong tensor. The
integration counts mispredictions (tests assert there are none).
"""

from __future__ import annotations

from typing import Hashable, List, Optional, Sequence, Tuple

MicroBatchKey = Tuple[int, int]  # (model chunk, micro-batch)


class BackwardOrder:
    """The backward order of one step on one rank, and the warm-up length that places it.

    Args:
        backward_keys: micro-batch keys in the order their backwards run.
        num_warmup: forwards that run before the first backward.
    """

    def __init__(self, backward_keys: Sequence[MicroBatchKey], num_warmup: int) -> None:
        self.backward_keys: List[MicroBatchKey] = list(backward_keys)
        self.total = len(self.backward_keys)
        self.num_warmup = min(max(num_warmup, 0), self.total)

    @classmethod
    def one_chunk(cls, num_microbatches: int, num_warmup: int) -> "BackwardOrder":
        """No pipelining (``num_warmup`` 0) and non-interleaved 1F1B."""
        return cls([(0, m) for m in range(num_microbatches)], num_warmup)

    @classmethod
    def interleaved(cls, schedule_table: Sequence[Tuple[int, int]], num_model_chunks: int,
                    num_warmup: int) -> "BackwardOrder":
        """Interleaved 1F1B: ``schedule_table`` is megatron's ``get_schedule_table()``, one
        (micro-batch, model chunk) per virtual micro-batch in forward order. The b-th backward
        takes the same row with the chunk order reversed (the last chunk goes first)."""
        keys = [(num_model_chunks - 1 - chunk, mb) for mb, chunk in schedule_table]
        return cls(keys, num_warmup)

    def after_forward(self, forwards_done: int) -> Optional[MicroBatchKey]:
        """Key of the backward that follows the ``forwards_done``-th forward (1-based), or None
        when another forward comes first."""
        f = forwards_done - 1
        if f >= self.num_warmup:
            return self._key(f - self.num_warmup)
        if f == self.total - 1:  # every forward was warm-up: the cool-down starts now
            return self._key(0)
        return None

    def after_backward(self, backwards_done: int) -> Optional[MicroBatchKey]:
        """Key of the backward that follows the ``backwards_done``-th backward (1-based), or
        None when a forward (or nothing) comes first."""
        steady = self.total - self.num_warmup
        if backwards_done >= steady:
            return self._key(backwards_done)
        return None

    def _key(self, b: int) -> Optional[Hashable]:
        return self.backward_keys[b] if 0 <= b < self.total else None
