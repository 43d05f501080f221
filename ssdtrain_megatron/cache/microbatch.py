"""A micro-batch's namespace inside the one offloader: its records, layers and prefetch cursor."""

from __future__ import annotations

from typing import Hashable, List, Optional

from .lifecycle import State
from .record import TensorRecord


class MicroBatch:
    """Records saved by one micro-batch's forward, in save order.

    Layers are numbered by the order this micro-batch entered them (``layer_index``), so the
    prefetch window and ``keep_last_layers`` count real layers whatever keys the caller uses.
    """

    def __init__(self, key: Hashable) -> None:
        self.key = key
        self.records: List[TensorRecord] = []  # save order
        self.layer_keys: List[Hashable] = []  # forward order of annotated layers
        self.layer_index = {}  # layer key -> position in layer_keys
        self.position = -1  # index of the layer forward is in (or last left); -1 before the first
        self.deferred: List[TensorRecord] = []  # SAVED records waiting for their write
        self.in_backward = False
        self.backward_layer: Optional[int] = None  # lowest layer index unpacked so far
        self.cursor = 0  # records[-1 - cursor] is the next prefetch candidate
        self.readahead_bytes = 0  # bytes read ahead and not yet unpacked

    def enter_layer(self, key: Hashable) -> int:
        idx = self.layer_index.get(key)
        if idx is None:
            idx = self.layer_index[key] = len(self.layer_keys)
            self.layer_keys.append(key)
        self.position = idx
        return idx

    @property
    def annotated(self) -> bool:
        return bool(self.layer_keys)

    @staticmethod
    def index_of(record: TensorRecord) -> int:
        """Forward position of a record: the layer it was saved in, or for tensors saved between
        layers (embedding, head, loss) the last layer entered before them."""
        return record.pos

    def take_deferred_before(self, layer_idx: int) -> List[TensorRecord]:
        """Deferred records of layers with index < layer_idx (now old enough to write)."""
        ready = [r for r in self.deferred if self.index_of(r) < layer_idx]
        if ready:
            self.deferred = [r for r in self.deferred if self.index_of(r) >= layer_idx]
        return ready

    def take_all_deferred(self) -> List[TensorRecord]:
        out, self.deferred = self.deferred, []
        return out

    def prefetch_candidates(self, window: int, byte_cap: int) -> List[TensorRecord]:
        """Next records to read, in reverse save order, within the layer window and byte cap.

        The window is ``window`` layers below the lowest layer backward has reached; with no
        layer annotations every record is in the window and only the byte cap applies.
        """
        out = []
        floor = -1
        if self.layer_keys:
            top = self.backward_layer if self.backward_layer is not None else len(self.layer_keys)
            floor = top - window
        n = len(self.records)
        while self.cursor < n:
            rec = self.records[n - 1 - self.cursor]
            if rec.state != State.ON_DISK and rec.state != State.WRITING and rec.state != State.STAGED:
                self.cursor += 1  # nothing to read: in memory, already asked for, or gone
                continue
            if rec.pos < floor:  # index_of, inline: once per record read back
                break
            if self.readahead_bytes and self.readahead_bytes + rec.nbytes > byte_cap:
                break
            self.cursor += 1
            rec.readahead = True
            self.readahead_bytes += rec.nbytes
            out.append(rec)
        return out

    def consumed(self, record: TensorRecord) -> None:
        """Backward took (or dropped) a record: it no longer counts as read-ahead."""
        if record.readahead:
            self.readahead_bytes -= record.nbytes
            record.readahead = False
