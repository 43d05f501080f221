"""The bytes a tensor spans, and a queued copy as CUDA runs it over them: what the recorder
(tests/recording_streams.py) and the staging checks (tests/staging_checks.py) compare. Kept apart
from the recorder, which is about streams and clocks, not bytes."""

from __future__ import annotations

import torch

from tests.stand_in_allocator import POISON


def _copy_or_stale(dst: torch.Tensor, src: torch.Tensor) -> None:
    """A queued copy as CUDA runs it. A source whose storage its owner freed in place
    (``resize_(0)``) after the copy was issued still has its bytes in the caching allocator's
    block on a GPU: the copy reads stale (or reused) bytes, it does not fault. Here the CPU
    storage is gone, so the copy writes poison instead of reading freed memory."""
    last = src.storage_offset() + sum((n - 1) * st for n, st in zip(src.shape, src.stride()))
    if src.numel() and src.untyped_storage().nbytes() < (last + 1) * src.element_size():
        try:
            dst.view(torch.uint8).fill_(POISON)
        except RuntimeError:  # a view whose bytes cannot be seen as uint8: any wrong value will do
            dst.fill_(-1)
        return
    dst.copy_(src)


def _range(t: torch.Tensor) -> tuple:
    """(first byte, one past the last byte) that ``t`` spans."""
    start = t.data_ptr()
    if t.numel() == 0:
        return (start, start)
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return (start, start + span * t.element_size())


def overlaps(a: tuple, b: tuple) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def contains(outer: tuple, inner: tuple) -> bool:
    return outer[0] <= inner[0] and inner[1] <= outer[1]
