"""One saved activation: what autograd saved, its geometry, and the bytes the engine moves.

A :class:`TensorRecord` is made by the pack hook (``hooks.py``) through the record table
(``table.py``) and moved between its states only by ``lifecycle.move`` (``lifecycle.py`` holds
the states and the table of allowed transitions; ``State`` and ``TRANSITIONS`` are importable
from here too). This module knows the tensor's side: which bytes to store (``bytes_view``),
where restored bytes go (``allocate_restore``), and whether the saved tensor changed.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Hashable, Optional, Tuple

import torch

from .lifecycle import TRANSITIONS, State

__all__ = ["ALIGN_RESIDUE", "State", "StorageFreed", "TRANSITIONS", "TensorRecord", "span_elements"]

ALIGN_RESIDUE = 512  # restore tensors at the same address alignment (mod 512) they had


class TensorRecord:
    """A saved tensor, the handle autograd holds for it, and where its bytes are."""

    __slots__ = ("id", "microbatch", "layer", "state", "tensor", "ref", "storage_ref", "version", "shape",
                 "stride", "dtype", "device", "span", "dense", "nbytes", "residue", "compact", "staging", "handles",
                 "error", "readahead", "decision", "pos", "last_pos", "shared", "transfer", "read_retries",
                 "site", "inflight", "__weakref__")

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
        self.state = State.SAVED
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
        self.read_retries = 0  # failed reads retried so far (reads.py: READ_RETRIES)
        self.inflight = False  # its bytes count in the transfers' bytes in flight (transfers.py)

    def storage_alive(self) -> bool:
        """The saved tensor's storage still exists (a deduplication hit may use this record)."""
        return bool(self.storage_ref) and not torch.UntypedStorage._expired(self.storage_ref)

    @property
    def state_name(self) -> str:
        return State.NAMES[self.state]

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

    def storage_span(self) -> Optional[Tuple[int, int]]:
        """(address, bytes) of the saved tensor's storage, None once it is let go: what a free in
        place (``resize_(0)``) changes, compared when a copy lands (Transfers._landed)."""
        t = self.tensor
        return None if t is None else (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())

    def hold(self) -> torch.Tensor:
        """Hold a detached alias of the saved tensor (same storage and version counter, no
        grad_fn) instead of the tensor itself, if not yet; returns it."""
        t = self.tensor
        if t.requires_grad:
            t = self.tensor = t.detach()
        return t

    def allocate_restore(self, align: int = ALIGN_RESIDUE, empty: Callable[..., torch.Tensor] = torch.empty,
                         pad: bool = True) -> Tuple[torch.Tensor, torch.Tensor]:
        """(tensor with the saved shape/stride, contiguous tensor to read the bytes into: the
        first itself when it is dense, io/base.py).

        The new tensor sits at the same address alignment (mod 512) as the original: some
        CPU kernels choose their vector path by alignment, and bitwise-equal gradients must
        not depend on where the bytes came back to. ``align`` (a multiple of 512, e.g. 4096
        for cuFile, which bounces unaligned buffers) makes it the same residue modulo
        ``align``: a tensor that started on a 512-byte boundary (most do) comes back on an
        ``align`` boundary; a compact record's packed bytes start on one. ``empty``: where the
        memory comes from (``torch.empty``'s signature; on a CPU device, the offloader's
        restore_pool.py; on the GPU path, the caching allocator on the compute stream named
        at install, whose pool the original's block went back to: device_copy.py). ``pad=False``:
        ``empty`` gives ``align``-aligned memory (CUDA's caching allocator: 512 bytes), so a
        tensor that started on a boundary is allocated at exactly its bytes, in the size
        class of the block it came from (padding it would put it in the next one, where it
        cannot reuse that block); only one at another residue is padded to reach it.
        """
        itemsize = self.dtype.itemsize
        extra = 0 if not pad and self.residue % align == 0 else align // itemsize
        storage = empty(self.span + extra, dtype=self.dtype, device=self.device)
        delta = (self.residue - storage.data_ptr() % align) % align
        offset = delta // itemsize if extra and delta % itemsize == 0 else 0
        restored = storage.as_strided(self.shape, self.stride, offset)
        if self.compact:  # read packed elements, scatter them into the strided view after
            self.staging = _aligned_empty(self.shape, self.dtype, self.device, align, empty, pad)
            return restored, self.staging
        if self.dense:
            return restored, restored
        return restored, storage[offset:offset + self.span]

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

    def note_modified(self) -> bool:
        """Whether the tensor was modified in place while it was being offloaded; if so, the
        record's ``error`` says so (the write completes; what backward gets is decided by
        whoever asks)."""
        t = self.tensor
        if t is None or t._version == self.version:
            return False
        self.error = (f"a {self.describe()} was modified in place while it was being "
                      f"offloaded (version {self.version} -> {t._version})")
        return True

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
                   empty: Callable[..., torch.Tensor] = torch.empty, pad: bool = True) -> torch.Tensor:
    """A contiguous tensor whose first byte is on an ``align`` boundary (when the allocator's
    own alignment is a multiple of the element size, as it is; ``pad=False``: the allocator
    aligns to ``align`` itself, so no padding is needed)."""
    itemsize = dtype.itemsize
    n = 1
    for s in shape:
        n *= s
    extra = align // itemsize if pad else 0
    raw = empty(n + extra, dtype=dtype, device=device)
    delta = (-raw.data_ptr()) % align
    skip = delta // itemsize if extra and delta % itemsize == 0 else 0
    return raw[skip:skip + n].view(shape)


def span_elements(t: torch.Tensor) -> int:
    """Elements of storage from the first to the last element the view touches."""
    if t.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
