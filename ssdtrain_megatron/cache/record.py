"""One saved activation: its geometry and its life as an explicit state machine.

Every fact about where a record's bytes are and who waits for them is its ``state`` (an int);
``TRANSITIONS`` below is the whole lifecycle, and ``TensorRecord.move`` is the only place a
state changes: it refuses any other transition, so a bookkeeping bug surfaces as an error
instead of a wrong tensor. The counters each transition adds to (``StepCounters``) are in the
same table, so a tensor is counted once per thing that happened to it.

    SAVED ─submit─▶ WRITING ──ok──▶ ON_DISK ──read──▶ READING ──ok──▶ READY
      │              │  │ unpack/prefetch     │ still alive ─────────────▶ READY
      │              │  ▼                     │                               ▲
      │              │ WRITING_WANTED ──ok────┼───────────────────────────────┘
      │              │  (error: fallback)     │
      └──keep──▶ KEPT ◀┘                      READING ──error / WRITING ──modified in place──▶ BROKEN
                                             READING ──error, retries left──▶ ON_DISK (read again)
    WRITING, READING ──last handle dropped──▶ WRITE_DROPPED / READ_DROPPED ──IO ends──▶ … ▶ RELEASED
    WRITING_WANTED ──last handle dropped──▶ (stays; forwarded) ──write ends──▶ READY ▶ RELEASED
    every other state ──last handle dropped──▶ RELEASED
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import torch

ALIGN_RESIDUE = 512  # restore tensors at the same address alignment (mod 512) they had


class State:
    """The record states (plain ints: compared on every pack and unpack)."""

    SAVED = 0  # in memory, write not started (deferred: may still be kept)
    KEPT = 1  # stays in memory for this step (policy, last layers or write fallback)
    WRITING = 2  # write in flight; our alias holds the bytes until it completes
    WRITING_WANTED = 3  # write in flight and backward wants the tensor: keep our alias after it
    WRITE_DROPPED = 4  # write in flight and no user left: release when it completes
    ON_DISK = 5  # written; only the engine has the bytes
    READING = 6  # read in flight into a new tensor
    READ_DROPPED = 7  # read in flight and no user left: release when it completes
    READY = 8  # in memory for backward (read back, or forwarded)
    BROKEN = 9  # cannot be given to backward: ``error`` says why (unpack raises it)
    RELEASED = 10

    NAMES = ("saved", "kept", "writing", "writing", "writing", "on_disk", "reading", "reading",
             "ready", "broken", "released")
    """What each state is in an error message (the dropped/wanted variants read as their IO)."""


S = State
# States in which the record holds the bytes in memory.
RESIDENT = frozenset({S.SAVED, S.KEPT, S.WRITING, S.WRITING_WANTED, S.WRITE_DROPPED, S.READING,
                      S.READ_DROPPED, S.READY})
# States with IO in flight (the engine still uses the record's key and memory).
IN_FLIGHT = frozenset({S.WRITING, S.WRITING_WANTED, S.WRITE_DROPPED, S.READING, S.READ_DROPPED})
WRITES = frozenset({S.WRITING, S.WRITING_WANTED, S.WRITE_DROPPED})
READS = frozenset({S.READING, S.READ_DROPPED})

# (from, to) -> what the step's counters record when it happens: "kept" (tensors_kept),
# "offloaded" (a write completed: tensors/bytes_offloaded), "fallback" (a write failed: the
# tensor stays in memory), "forwarded" (backward gets the in-memory tensor, no read),
# "taken_back" (a write not yet started was cancelled because backward wants the tensor),
# "held" (written, then found alive at backward: held by someone else, so written for nothing),
# "read" (bytes came back from the engine), "written_forwarded" (written, but backward took the
# tensor from memory while the write was under way), "released_unread" (written, then released
# without a read: its graph was dropped, or the step ended without its backward),
# "written_modified" (written, but modified in place meanwhile: it cannot be read back).
# "held", "written_forwarded", "released_unread" and "written_modified" are the ways a written
# byte is wasted; the step's counters add each one up by the record's origin
# (``TensorRecord.origin``). Any pair not listed is a bug.
TRANSITIONS: Dict[Tuple[int, int], Tuple[str, ...]] = {
    (S.SAVED, S.WRITING): (),
    (S.SAVED, S.KEPT): ("kept",),
    (S.SAVED, S.RELEASED): (),
    (S.KEPT, S.RELEASED): (),
    (S.WRITING, S.WRITING_WANTED): ("forwarded",),  # unpack or prefetch during the write
    (S.WRITING, S.READY): ("forwarded", "taken_back"),  # ... before it started: cancelled
    (S.WRITING, S.ON_DISK): ("offloaded",),
    (S.WRITING, S.BROKEN): ("offloaded", "written_modified"),  # modified in place meanwhile
    (S.WRITING, S.KEPT): ("fallback", "kept"),
    (S.WRITING, S.WRITE_DROPPED): (),
    (S.WRITING, S.RELEASED): (),  # close() stopped waiting for a hung write
    (S.WRITING_WANTED, S.READY): ("offloaded", "written_forwarded"),
    (S.WRITING_WANTED, S.BROKEN): ("offloaded", "written_forwarded"),  # then changed by backward
    (S.WRITING_WANTED, S.KEPT): ("fallback", "kept"),
    (S.WRITING_WANTED, S.RELEASED): (),
    (S.WRITE_DROPPED, S.WRITING): (),  # saved again (dedup) before its write completed
    (S.WRITE_DROPPED, S.ON_DISK): ("offloaded",),  # then released at once
    (S.WRITE_DROPPED, S.KEPT): ("fallback", "kept"),  # then released at once
    (S.WRITE_DROPPED, S.RELEASED): (),  # a queued write cancelled, or close()
    (S.ON_DISK, S.READING): (),
    (S.ON_DISK, S.READY): ("forwarded", "held"),  # still referenced elsewhere: no read needed
    (S.ON_DISK, S.RELEASED): ("released_unread",),
    (S.READING, S.READY): ("read",),
    (S.READING, S.BROKEN): (),
    (S.READING, S.ON_DISK): ("read_retried",),  # a failed read, tried again (READ_RETRIES)
    (S.READING, S.READ_DROPPED): (),
    (S.READING, S.RELEASED): (),
    (S.READ_DROPPED, S.READING): (),  # saved again (dedup) before its read completed
    (S.READ_DROPPED, S.READY): ("read",),  # then released at once
    (S.READ_DROPPED, S.BROKEN): (),
    (S.READ_DROPPED, S.RELEASED): (),
    (S.READY, S.RELEASED): (),
    (S.BROKEN, S.RELEASED): (),
}


class TensorRecord:
    """A saved tensor, the handle autograd holds for it, and where its bytes are."""

    __slots__ = ("id", "microbatch", "layer", "state", "tensor", "ref", "storage_ref", "version", "shape",
                 "stride", "dtype", "device", "span", "dense", "nbytes", "residue", "compact", "staging", "handles",
                 "error", "readahead", "decision", "pos", "last_pos", "shared", "transfer", "read_retries",
                 "site", "__weakref__")

    def __init__(self, rid: int, t: torch.Tensor, microbatch: Hashable, layer: Hashable,
                 geometry: Optional[Tuple] = None, storage_ref: int = 0) -> None:
        """``geometry``: (shape, stride, dtype, version, device) as the pack hook already read
        them (each tensor attribute is read once per tensor); default: read from ``t``.
        ``storage_ref``: a weak reference to ``t``'s storage (``UntypedStorage._weak_ref()``);
        whoever made it frees it (the offloader, at the end of the step)."""
        if geometry is None:
            geometry = (t.shape, t.stride(), t.dtype, t._version, t.device)
        self.id = rid
        self.microbatch = microbatch
        self.layer = layer
        self.state = S.SAVED
        # The bytes we hold. A record that stays in memory (kept, deferred) holds a detached
        # alias (``hold``): same storage and version counter, no grad_fn, so holding it keeps
        # no autograd graph alive. One handed to the engine at once holds the saved tensor
        # itself until its write completes: ``detach`` is a torch call that releases the GIL,
        # and in the pack hook that release lets a waiting IO thread take the interpreter from
        # the training thread (measured: 1.5-5 µs a pack while IO runs). Meanwhile a graph
        # dropped without backward stays alive (tensor -> grad_fn -> handle -> record ->
        # tensor) until the write completes (ON_DISK drops it) or the step ends; a backward
        # releases saved tensors as usual. Backward gets the detached alias too (``hold``).
        self.tensor: Optional[torch.Tensor] = t
        self.ref = weakref.ref(t)  # to forward a tensor that is still alive, and detect in-place changes
        # A plain int (no Python object per tensor): while it is held the storage's address
        # cannot be reused, so a deduplication hit is never a freed and re-allocated buffer.
        self.storage_ref = storage_ref
        self.shape, self.stride, self.dtype, self.version, self.device = geometry
        numel = t.numel()
        # The common case, a contiguous activation, needs no span arithmetic and no view.
        self.dense = t.is_contiguous()
        self.span = numel if self.dense else span_elements(t)
        # A view that touches less than half of the storage span it lies in (V split out of a
        # fused QKV projection) is stored compactly, so we move its bytes and not its span.
        self.compact = self.span > 2 * numel
        self.nbytes = (numel if self.compact else self.span) * self.dtype.itemsize
        self.staging: Optional[torch.Tensor] = None  # compact bytes in flight (write or read)
        self.residue = t.data_ptr() % ALIGN_RESIDUE
        self.handles = 0
        self.error: Optional[str] = None  # BROKEN: why backward cannot have this tensor
        self.readahead = False  # counted in its micro-batch's read-ahead bytes (prefetch bookkeeping)
        self.decision = "offload"
        self.pos = -1  # forward position in its micro-batch (see MicroBatch.index_of)
        self.last_pos = -1  # position of its latest save (dedup hits in later layers)
        self.shared = False  # also saved by another micro-batch (a shared mask, RoPE table)
        self.transfer = None  # its GPU copy in flight (cache/device_copy.py), if any
        self.read_retries = 0  # failed reads retried so far (transfers.py: READ_RETRIES)

    def storage_alive(self) -> bool:
        """The saved tensor's storage still exists (a deduplication hit may use this record)."""
        return bool(self.storage_ref) and not torch.UntypedStorage._expired(self.storage_ref)

    def move(self, new: int) -> Tuple[str, ...]:
        """Change state; returns what the step's counters record for this transition."""
        effects = TRANSITIONS.get((self.state, new))
        if effects is None:
            raise RuntimeError(f"ssdtrain internal error: record {self.id} cannot go from "
                               f"{S.NAMES[self.state]} ({self.state}) to {S.NAMES[new]} ({new})")
        self.state = new
        return effects

    @property
    def state_name(self) -> str:
        return S.NAMES[self.state]

    def bytes_view(self, contiguous: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
        """The bytes to store, as a contiguous tensor (the engine takes the uint8 view on its
        own thread, io/base.py): a dense tensor as it is, the span of a strided one (no copy),
        or for a compact record a packed copy of its elements, made by ``contiguous`` (default
        ``Tensor.contiguous``; on a GPU a kernel on the current stream: whoever reads the bytes
        must wait for an event recorded *after* this call)."""
        t = self.tensor
        if self.dense:
            return t
        t = t.detach()  # the copy or view below must not join the autograd graph
        if self.compact:
            return contiguous(t) if contiguous is not None else t.contiguous()
        return t.as_strided((self.span,), (1,), t.storage_offset())

    def check_storage(self) -> None:
        """Raise StorageFreed when the saved tensor's storage no longer holds its bytes: its
        owner freed it in place (``untyped_storage().resize_(0)``, as Megatron's
        CheckpointWithoutOutput does with an output it will recompute) after it was saved."""
        t = self.tensor
        if t.untyped_storage().nbytes() < (t.storage_offset() + self.span) * self.dtype.itemsize:
            raise StorageFreed(f"the storage of a {self.describe()} was freed in place by its owner "
                               "before its write (resize_(0) after it was saved); kept in memory")

    def hold(self) -> torch.Tensor:
        """Hold a detached alias of the saved tensor (same storage and version counter, no
        grad_fn) instead of the tensor itself, if not yet; returns it."""
        t = self.tensor
        if t.requires_grad:
            t = self.tensor = t.detach()
        return t

    def allocate_restore(self, align: int = ALIGN_RESIDUE,
                         empty: Callable[..., torch.Tensor] = torch.empty) -> Tuple[torch.Tensor, torch.Tensor]:
        """(tensor with the saved shape/stride, contiguous tensor to read the bytes into: the
        first itself when it is dense, io/base.py).

        The new tensor sits at the same address alignment (mod 512) as the original: some
        CPU kernels choose their vector path by alignment, and bitwise-equal gradients must
        not depend on where the bytes came back to. ``align`` (a multiple of 512, e.g. 4096
        for cuFile, which bounces unaligned device buffers) makes it the same residue modulo
        ``align``: a tensor that started on a 512-byte boundary (most do) comes back on an
        ``align`` boundary; a compact record's packed bytes start on one. ``empty``: where the
        memory comes from (``torch.empty``'s signature; on a CPU device, the offloader's
        restore_pool.py).
        """
        itemsize = self.dtype.itemsize
        extra = align // itemsize
        storage = empty(self.span + extra, dtype=self.dtype, device=self.device)
        delta = (self.residue - storage.data_ptr() % align) % align
        pad = delta // itemsize if delta % itemsize == 0 else 0
        restored = storage.as_strided(self.shape, self.stride, pad)
        if self.compact:  # read packed elements, scatter them into the strided view after
            self.staging = _aligned_empty(self.shape, self.dtype, self.device, align, empty)
            return restored, self.staging
        if self.dense:
            return restored, restored
        return restored, storage[pad:pad + self.span]

    def finish_read(self) -> None:
        """After the read: a compact record's packed bytes go to their strided places."""
        if self.staging is not None:
            self.tensor.copy_(self.staging)
            self.staging = None

    def origin(self) -> str:
        """Where the tensor came from, as far as the record knows without work at pack: its
        layer, dtype and shape; with ``debug_save_sites`` also the code that saved it (``site``,
        a slot set by the debugging pack hook only, cache/hooks.py)."""
        where = f"layer {self.layer}" if self.layer is not None else "no layer scope"
        site = getattr(self, "site", None)
        return (f"{where} {str(self.dtype).removeprefix('torch.')}{list(self.shape)}"
                + (f" at {site}" if site else ""))

    def describe(self) -> str:
        """The tensor in an error message: geometry, and where the model saved it."""
        where = f"layer {self.layer}" if self.layer is not None else "no layer scope"
        return (f"tensor of shape {list(self.shape)} and dtype {self.dtype} ({where}, "
                f"micro-batch {self.microbatch})")

    def check_version(self, t: Any) -> None:
        if t is not None and t._version != self.version:
            raise RuntimeError(
                f"a {self.describe()} saved for backward was modified in place after it was saved "
                f"(version {self.version} -> {t._version}); its gradient would be wrong. "
                f"Clone it before the in-place op, or make the op out-of-place.")


class StorageFreed(RuntimeError):
    """A write refused because the saved tensor's storage was freed in place by its owner before
    the write started (``TensorRecord.check_storage``): the record stays in memory, where the
    owner restores the storage before backward, as it would without us."""


def _aligned_empty(shape, dtype: torch.dtype, device: torch.device, align: int,
                   empty: Callable[..., torch.Tensor] = torch.empty) -> torch.Tensor:
    """A contiguous tensor whose first byte is on an ``align`` boundary (when the allocator's
    own alignment is a multiple of the element size, as it is)."""
    itemsize = dtype.itemsize
    n = 1
    for s in shape:
        n *= s
    raw = empty(n + align // itemsize, dtype=dtype, device=device)
    delta = (-raw.data_ptr()) % align
    skip = delta // itemsize if delta % itemsize == 0 else 0
    return raw[skip:skip + n].view(shape)


def span_elements(t: torch.Tensor) -> int:
    """Elements of storage from the first to the last element the view touches."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
