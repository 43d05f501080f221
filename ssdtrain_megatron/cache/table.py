"""The record table: which saved tensors the offloader has, under which identity, in which
micro-batch, and which storages it never takes.

Identity (``identity.py``) is (storage, offset, shape, stride, dtype, version): the same tensor
saved twice finds its record here and is written once (deduplication); two views of one
storage are two records. A record is findable by identity only while its storage lives and
only within its step: the table holds a weak reference to each record's storage (a plain
int) until the step ends, so the storage's address cannot be reused by another storage
meanwhile and a key never names two storages.

Micro-batches are the namespace of records (``microbatch.py``): the forward position of each
record, the deferred last layers, the prefetch cursor. Parameters and storages something else
holds until backward (``held.py``) pass through the pack hook; the table answers those
questions too. The training thread owns all of it.
"""

from __future__ import annotations

import itertools
from typing import Dict, Hashable, Iterable, List, Optional, Set, Tuple

import torch

from .held import HeldStorages
from .lifecycle import State
from .microbatch import MicroBatch
from .record import TensorRecord

_free_weak_ref = torch.UntypedStorage._free_weak_ref


class RecordTable:
    """Records by id and by identity, the step's micro-batches, and the storages never taken."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._records: Dict[int, TensorRecord] = {}
        self._by_identity: Dict[tuple, TensorRecord] = {}
        # Weak references to the storages of this step's records (plain ints): while one is
        # held, that storage's address cannot be reused, so a key in _by_identity names one storage.
        self._storage_refs: List[int] = []
        self._param_storages: Set[int] = set()
        self._held = HeldStorages()
        self._microbatches: Dict[Hashable, MicroBatch] = {}

    # -- storages never offloaded -------------------------------------------------------------

    @property
    def param_storages(self) -> Set[int]:
        """Storage addresses of registered parameters (the pack hook's ``offloadable_storage``
        reads this set, taken once: it changes in place; register through
        :meth:`register_parameters`)."""
        return self._param_storages

    def register_parameters(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            self._param_storages.add(p.untyped_storage()._cdata)

    def register_held(self, tensors: Iterable[Optional[torch.Tensor]], device: torch.device) -> None:
        self._held.register(tensors, device)

    def learn_held(self, storage: torch.UntypedStorage) -> None:
        """A record found alive at backward: later saves of its storage pass through."""
        self._held.learn(storage)

    @property
    def held_addresses(self) -> Set[int]:
        """Addresses of the storages something else holds until backward (``held.py``): the
        pack hook reads this set once and tests ``cdata in`` it per tensor (it changes in place)."""
        return self._held.addresses

    # -- records --------------------------------------------------------------------------------

    def find(self, key: tuple) -> Optional[TensorRecord]:
        """The live record of this identity, if the same tensor was saved before in this step."""
        rec = self._by_identity.get(key)
        if rec is not None and rec.state != State.RELEASED and rec.storage_alive():
            return rec
        return None

    def add(self, t: torch.Tensor, key: tuple, storage: torch.UntypedStorage,
            mb: Optional[MicroBatch], layer: Hashable, geometry: Tuple) -> TensorRecord:
        """A new record for ``t`` (identity ``key``, on ``storage``), saved in ``mb``'s forward
        at ``layer``; ``geometry`` as :class:`TensorRecord` takes it."""
        sref = storage._weak_ref()
        self._storage_refs.append(sref)  # freed at the step's end, when identities are forgotten
        rec = TensorRecord(next(self._ids), t, mb.key if mb is not None else None, layer, geometry, sref)
        rec.handles = 1
        self._records[rec.id] = rec
        self._by_identity[key] = rec
        if mb is not None:
            rec.pos = rec.last_pos = mb.position
            mb.records.append(rec)
        return rec

    def get(self, rid: int) -> Optional[TensorRecord]:
        return self._records.get(rid)

    def __contains__(self, rid: int) -> bool:
        return rid in self._records

    def __len__(self) -> int:
        return len(self._records)

    def records(self) -> List[TensorRecord]:
        """Every record not yet released (a copy: safe to release while iterating)."""
        return list(self._records.values())

    def remove(self, rec: TensorRecord) -> None:
        """A released record leaves the table (and its micro-batch's read-ahead)."""
        self._records.pop(rec.id, None)
        mb = self._microbatches.get(rec.microbatch)
        if mb is not None:
            mb.consumed(rec)

    # -- micro-batches ----------------------------------------------------------------------------

    def microbatch(self, key: Hashable) -> Tuple[MicroBatch, bool]:
        """The micro-batch ``key`` of this step, and whether it was just created."""
        mb = self._microbatches.get(key)
        if mb is not None:
            return mb, False
        mb = self._microbatches[key] = MicroBatch(key)
        return mb, True

    def find_microbatch(self, key: Hashable) -> Optional[MicroBatch]:
        return self._microbatches.get(key)

    def microbatches(self) -> List[MicroBatch]:
        return list(self._microbatches.values())

    def in_forward(self) -> List[MicroBatch]:
        """Micro-batches whose backward has not started (their deferred records may be written)."""
        return [mb for mb in self._microbatches.values() if not mb.in_backward]

    @property
    def microbatch_count(self) -> int:
        return len(self._microbatches)

    # -- step and job ends ----------------------------------------------------------------------

    def forget_identities(self) -> None:
        """No record of this step is looked up by identity any more: drop the storage refs."""
        self._by_identity.clear()
        for ref in self._storage_refs:
            _free_weak_ref(ref)
        self._storage_refs = []

    def end_step(self) -> None:
        self.forget_identities()
        self._held.end_step()
        self._microbatches.clear()

    def close(self) -> None:
        self.forget_identities()
        self._held.close()
