"""Storages that something besides autograd keeps in memory until backward needs them.

Writing such a tensor spends drive bandwidth and endurance and frees nothing: at backward it
is still alive, so it is forwarded from memory and its bytes are never read back. Two ways to
know one:

- registered for the step (``ActivationOffloader.register_held``): the pipeline schedule's
  received input, which Megatron keeps in ``input_tensors`` until that micro-batch's backward;
- learned: a record found alive at backward (the caller's batch, a causal mask or a rotary
  table that the model caches). The same storage saved in a later step passes through while
  it lives; a fresh tensor each step (labels) is written and found alive again, which costs
  only its own bytes.

Passing a tensor through keeps it exactly as autograd would: never a numerics risk, at worst
memory not freed that was not going to be freed anyway.

Each storage is tracked by its C++ object's address (``_cdata``) and a weak reference to that
object, which keeps the address from being reused by another storage while it is tracked.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Set

import torch

#: Learned storages tracked at most (a model caches a handful: masks, rotary tables).
MAX_LEARNED = 4096

_free = torch.UntypedStorage._free_weak_ref
_expired = torch.UntypedStorage._expired


class HeldStorages:
    """``cdata in held.addresses``: a saved tensor on that storage passes through (hooks.py)."""

    __slots__ = ("step", "learned", "addresses")

    def __init__(self) -> None:
        self.step: Dict[int, int] = {}
        """Registered this step: storage address -> weak reference (freed at the step's end)."""
        self.learned: Dict[int, int] = {}
        """Found alive at backward: storage address -> weak reference (kept while it lives)."""
        self.addresses: Set[int] = set()
        """Every address in ``step`` or ``learned``: the pack hook's one test (a set, changed
        in place only, so a reference taken once stays current)."""

    def register(self, tensors: Iterable[Optional[torch.Tensor]], device: torch.device) -> None:
        """The storages of ``tensors`` on ``device`` (others and None are skipped), for this step."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device == device:
                storage = t.untyped_storage()
                if storage._cdata not in self.step:
                    self.step[storage._cdata] = storage._weak_ref()
                    self.addresses.add(storage._cdata)

    def learn(self, storage: torch.UntypedStorage) -> None:
        if storage._cdata not in self.learned and len(self.learned) < MAX_LEARNED:
            self.learned[storage._cdata] = storage._weak_ref()
            self.addresses.add(storage._cdata)

    def end_step(self) -> None:
        """Forget this step's registrations, and the learned storages that have been freed."""
        for ref in self.step.values():
            _free(ref)
        self.step.clear()
        for cdata, ref in list(self.learned.items()):
            if _expired(ref):
                _free(ref)
                del self.learned[cdata]
        self.addresses.clear()
        self.addresses.update(self.learned)

    def close(self) -> None:
        self.end_step()
        for ref in self.learned.values():
            _free(ref)
        self.learned.clear()
        self.addresses.clear()
