"""One saved activation: its geometry and its life as an explicit state machine.

    SAVED ──submit──▶ WRITING ──ok──▶ ON_DISK ──read──▶ READING ──ok──▶ READY
      │                  │ error (fallback)     │ still alive (forwarding)     │
      └──keep──▶ KEPT ◀──┘                      └──────────────▶ READY         │
    any state ──last handle dropped──▶ RELEASED ◀─────────────────────────────┘

``TensorRecord.move`` is the only place a state changes; it refuses any other transition,
so a bookkeeping bug surfaces as an error instead of a wrong tensor.
"""

from __future__ import annotations

import enum
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Hashable, Optional, Tuple

import torch

ALIGN_RESIDUE = 512  # restore tensors at the same address alignment (mod 512) they had


class State(enum.Enum):
    SAVED = "saved"  # in memory, write not started (deferred: may still be kept)
    KEPT = "kept"  # stays in memory for this step (policy, last layers or write fallback)
    WRITING = "writing"
    ON_DISK = "on_disk"
    READING = "reading"
    READY = "ready"  # back in memory for backward
    RELEASED = "released"


# States in which the record holds the bytes in memory.
RESIDENT = frozenset({State.SAVED, State.KEPT, State.WRITING, State.READING, State.READY})

_ALLOWED = {
    State.SAVED: {State.WRITING, State.KEPT, State.RELEASED},
    State.KEPT: {State.RELEASED},
    State.WRITING: {State.ON_DISK, State.KEPT, State.RELEASED},
    State.ON_DISK: {State.READING, State.READY, State.RELEASED},
    State.READING: {State.READY, State.RELEASED},
    State.READY: {State.RELEASED},
    State.RELEASED: set(),
}


class TensorRecord:
    """A saved tensor, the handle autograd holds for it, and where its bytes are."""

    __slots__ = ("id", "microbatch", "layer", "state", "tensor", "ref", "version", "shape", "stride",
                 "dtype", "device", "span", "nbytes", "residue", "compact", "staging", "handles", "future", "want_read",
                 "release_pending", "corrupt", "prefetched", "readahead", "decision", "pos", "last_pos", "shared", "transfer", "__weakref__")

    def __init__(self, rid: int, t: torch.Tensor, microbatch: Hashable, layer: Hashable) -> None:
        self.id = rid
        self.microbatch = microbatch
        self.layer = layer
        self.state = State.SAVED
        # While we hold the bytes we keep a detached alias: same storage and version counter,
        # but no grad_fn, so holding it neither keeps the autograd graph alive nor forms a
        # cycle through the handle that graph holds.
        self.tensor: Optional[torch.Tensor] = t.detach()
        self.ref = weakref.ref(t)  # to forward a tensor that is still alive, and detect in-place changes
        self.version = t._version
        self.shape = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.dtype = t.dtype
        self.device = t.device
        self.span = span_elements(t)
        # A view that touches less than half of the storage span it lies in (V split out of a
        # fused QKV projection) is stored compactly, so we move its bytes and not its span.
        self.compact = self.span > 2 * t.numel()
        self.nbytes = (t.numel() if self.compact else self.span) * t.element_size()
        self.staging: Optional[torch.Tensor] = None  # compact bytes in flight (write or read)
        self.residue = t.data_ptr() % ALIGN_RESIDUE
        self.handles = 0
        self.future: Optional[Future] = None
        self.want_read = False  # backward asked for it while the write was in flight
        self.release_pending = False
        self.corrupt: Optional[str] = None
        self.prefetched = False  # a read was scheduled by prefetch (never twice)
        self.readahead = False  # counted in its micro-batch's read-ahead bytes
        self.decision = "offload"
        self.pos = -1  # forward position in its micro-batch (see MicroBatch.index_of)
        self.last_pos = -1  # position of its latest save (dedup hits in later layers)
        self.shared = False  # also saved by another micro-batch (a shared mask, RoPE table)
        self.transfer = None  # its GPU copy in flight (cache/device_copy.py), if any

    def move(self, new: State) -> Tuple[bool, bool]:
        """Change state; returns (was resident, is resident) for the caller's accounting."""
        if new not in _ALLOWED[self.state]:
            raise RuntimeError(f"ssdtrain internal error: record {self.id} cannot go from "
                               f"{self.state.value} to {new.value}")
        before = self.state in RESIDENT
        self.state = new
        return before, new in RESIDENT

    def bytes_view(self, contiguous: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """The bytes to store as contiguous uint8: a view of the span (no copy), or for a
        compact record a packed copy of its elements, made by ``contiguous`` (default
        ``Tensor.contiguous``; on a GPU a kernel on the current stream: whoever reads the bytes
        must wait for an event recorded *after* this call)."""
        t = self.tensor
        if self.compact:
            packed = contiguous(t) if contiguous is not None else t.contiguous()
            return packed.view(-1).view(torch.uint8)
        return t.as_strided((self.span,), (1,), t.storage_offset()).view(torch.uint8)

    def allocate_restore(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(tensor with the saved shape/stride, uint8 view to read the bytes into).

        The new tensor sits at the same address alignment (mod 512) as the original: some
        CPU kernels choose their vector path by alignment, and bitwise-equal gradients must
        not depend on where the bytes came back to.
        """
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        extra = ALIGN_RESIDUE // itemsize
        storage = torch.empty(self.span + extra, dtype=self.dtype, device=self.device)
        delta = (self.residue - storage.data_ptr() % ALIGN_RESIDUE) % ALIGN_RESIDUE
        pad = delta // itemsize if delta % itemsize == 0 else 0
        restored = storage.as_strided(self.shape, self.stride, pad)
        if self.compact:  # read packed elements, scatter them into the strided view after
            self.staging = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            return restored, self.staging.view(-1).view(torch.uint8)
        return restored, storage[pad:pad + self.span].view(torch.uint8)

    def finish_read(self) -> None:
        """After the read: a compact record's packed bytes go to their strided places."""
        if self.staging is not None:
            self.tensor.copy_(self.staging)
            self.staging = None

    def describe(self) -> str:
        return f"tensor of shape {list(self.shape)} and dtype {self.dtype}"

    def check_version(self, t: Any) -> None:
        if t is not None and t._version != self.version:
            raise RuntimeError(
                f"a {self.describe()} saved for backward was modified in place after it was saved "
                f"(version {self.version} -> {t._version}); its gradient would be wrong. "
                f"Clone it before the in-place op, or make the op out-of-place.")


def span_elements(t: torch.Tensor) -> int:
    """Elements of storage from the first to the last element the view touches."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
