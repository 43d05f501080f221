"""An exactness oracle for the offloader: every tensor it packs is digested at pack, and what
its unpack returns for it is digested again and compared, bit for bit.

Why: losses and gradients judge exactness downstream, and they can hide a small error: a
one-ulp change of one restored element passed 4 of 4 runs of several tests that compare
gradients bitwise (issue 38, 4.2). The digest is taken of the bytes themselves (an integer
view of the tensor's elements in logical order, so +0.0 and -0.0 differ), with the dtype and
shape, at the two ends of the offloader's round trip.

How: inside ``with ExactnessOracle() as oracle``, ``torch.autograd.graph.saved_tensors_hooks``
is wrapped so that hooks whose pack function belongs to an ActivationOffloader are themselves
wrapped: pack digests the tensor and hands autograd the offloader's handle together with the
digest; unpack asks the offloader for the tensor and compares. Nothing of the offloader is
changed or reached into; other saved-tensor hooks (torch's checkpoint) pass as they are.
``report()`` says how many tensors were compared (and how many of them had been offloaded,
that is, packed into a handle rather than passed through) and lists every mismatch.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.autograd.graph as graph

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def digest(t: torch.Tensor) -> Optional[Tuple[str, tuple, int]]:
    """(dtype, shape, CRC32 of the elements' bytes in logical order), or None for a tensor
    whose bytes cannot be read so (not strided, a subclass without storage)."""
    try:
        t = t.detach()
        if t.layout != torch.strided:
            return None
        if t.dtype.is_complex:
            t = torch.view_as_real(t)
        flat = t.contiguous().reshape(-1)
        raw = flat.view(torch.uint8) if flat.numel() else flat
        # A copy: .numpy() marks the storage it shares as not resizable, and megatron-core's
        # CheckpointWithoutOutput frees its outputs with resize_(0) after they were saved.
        data = raw.cpu().clone().numpy().tobytes() if raw.numel() else b""
    except (RuntimeError, TypeError, NotImplementedError):
        return None
    return str(t.dtype), tuple(t.shape), zlib.crc32(data)


def _is_offloaders(hook: Callable) -> bool:
    """A method of an object of this package (the offloader, or whatever part of it owns the
    hooks): the hooks to check (either one: a test may wrap the pack hook in a function of its
    own). Torch's own (checkpoint's) are left alone."""
    owner = getattr(hook, "__self__", None)
    return owner is not None and type(owner).__module__.startswith("ssdtrain_megatron.")


class _Sealed:
    """What autograd holds instead of the offloader's handle: the handle and the digest."""

    __slots__ = ("handle", "digest", "offloaded", "where")

    def __init__(self, handle: Any, dig: Any, offloaded: bool, where: str) -> None:
        self.handle, self.digest, self.offloaded, self.where = handle, dig, offloaded, where


class ExactnessOracle:
    """See the module docstring. Re-entrant across offloaders; one per test."""

    def __init__(self) -> None:
        self.packed = 0
        self.compared = 0
        self.compared_offloaded = 0
        self.unreadable = 0
        self.mismatches: List[str] = []
        self._real: Optional[type] = None

    def __enter__(self) -> "ExactnessOracle":
        real = graph.saved_tensors_hooks
        oracle = self

        class Hooks(real):  # type: ignore[misc, valid-type]
            def __init__(self, pack_hook: Callable, unpack_hook: Callable) -> None:
                if _is_offloaders(pack_hook) or _is_offloaders(unpack_hook):
                    pack_hook, unpack_hook = oracle._wrap(pack_hook, unpack_hook)
                super().__init__(pack_hook, unpack_hook)

        self._real = real
        graph.saved_tensors_hooks = Hooks
        torch.autograd.graph.saved_tensors_hooks = Hooks
        return self

    def __exit__(self, *exc) -> None:
        graph.saved_tensors_hooks = self._real
        torch.autograd.graph.saved_tensors_hooks = self._real

    def _wrap(self, pack: Callable, unpack: Callable) -> Tuple[Callable, Callable]:
        def sealed_pack(t: torch.Tensor) -> _Sealed:
            dig = digest(t)
            handle = pack(t)
            self.packed += 1
            return _Sealed(handle, dig, not isinstance(handle, torch.Tensor),
                           f"{tuple(t.shape)} {t.dtype} (pack #{self.packed})")

        def sealed_unpack(s: _Sealed) -> torch.Tensor:
            out = unpack(s.handle)
            if s.digest is None:
                self.unreadable += 1
                return out
            got = digest(out)
            self.compared += 1
            self.compared_offloaded += s.offloaded
            if got != s.digest:
                self.mismatches.append(f"{'offloaded' if s.offloaded else 'passed-through'} tensor {s.where}: "
                                       f"packed {s.digest}, unpacked {got}")
            return out

        return sealed_pack, sealed_unpack

    def report(self) -> Dict[str, Any]:
        return {"packed": self.packed, "compared": self.compared, "compared_offloaded": self.compared_offloaded,
                "unreadable": self.unreadable, "mismatches": list(self.mismatches)}

    def assert_exact(self, offloaded: bool = True) -> None:
        """No restored tensor differs from what was packed; with ``offloaded``, at least one
        compared tensor went through the engine (a test that claims offload)."""
        assert not self.mismatches, "restored bytes differ from the packed ones:\n" + "\n".join(self.mismatches[:10])
        if offloaded:
            assert self.compared_offloaded > 0, f"no offloaded tensor was unpacked and compared: {self.report()}"
