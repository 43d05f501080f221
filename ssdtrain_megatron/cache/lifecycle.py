"""The life of a saved activation, as one table: its states, the transitions allowed between
them, and what each transition counts.

Every fact about where a record's bytes are and who waits for them is its ``state`` (an int).
:func:`move` is the only place a state changes: it looks the pair up in ``TRANSITIONS`` and
refuses any pair the table does not list (:class:`IllegalTransition`), so a bookkeeping bug
surfaces as an error naming the record, the two states and what the table allows, never as
a wrong tensor. The step's counters follow in the same call: a transition counts what its
row says (``StepCounters.count``), and resident bytes change exactly when a record enters or
leaves a state that holds its bytes in memory (``RESIDENT``). So a tensor is counted once per
thing that happened to it, whichever part of the offloader moved it.

In the words of the user-facing statistics: *queued* is SAVED (a write not handed over yet:
the deferred last layers, or back-pressure); *writing* the three WRITING states and the three
STAGED ones; *written* ON_DISK; *reading* the two READING states; *resident* KEPT (never
written) and READY (read back or forwarded); *released* RELEASED. *Fallback* (a write failed:
the tensor stays in memory) and *forwarded* (backward gets the in-memory tensor, no read) are
transitions, the rows that count ``fallback`` and ``forwarded``.

On the GPU path a drive engine's write has two parts: the device->host copy into pinned
staging, then the drive write from there. Once the copy has landed (its event answered
``query``) the device memory is let go: the record is STAGED, its bytes in host memory only,
not resident. A STAGED record backward wants is copied back to the device from its staging
block (``from_staging``: no read from the drive), taken back from the engine when its drive
write has not started (READY), else STAGED_WANTED until the write ends. A drive write that
fails after its copy landed brings the bytes back from staging too (KEPT: the fallback).

    SAVED ─submit─▶ WRITING ──ok──▶ ON_DISK ──read──▶ READING ──ok──▶ READY
      │              │  │ unpack/prefetch     │ still alive ─────────────▶ READY
      │              │  ▼                     │                               ▲
      │              │ WRITING_WANTED ──ok────┼───────────────────────────────┘
      │              │  (error: fallback)     │
      └──keep──▶ KEPT ◀┘                      READING ──error / WRITING ──modified in place──▶ BROKEN
                                             READING ──error, retries left──▶ ON_DISK (read again)
    WRITING, READING ──last handle dropped──▶ WRITE_DROPPED / READ_DROPPED ──IO ends──▶ … ▶ RELEASED
    WRITING_WANTED ──last handle dropped──▶ (stays; forwarded) ──write ends──▶ READY ▶ RELEASED
    WRITING ──copy landed──▶ STAGED ──ok──▶ ON_DISK;  STAGED ──wanted──▶ STAGED_WANTED ──ok──▶ READY
    STAGED ──wanted, write not started: taken back──▶ READY;  STAGED ──error──▶ KEPT (from staging)
    WRITE_DROPPED ──copy landed──▶ STAGED_DROPPED ──IO ends──▶ … ▶ RELEASED
    every other state ──last handle dropped──▶ RELEASED
"""

from __future__ import annotations

from typing import Dict, Tuple


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
    STAGED = 11  # drive write in flight from host staging; the device memory is let go
    STAGED_WANTED = 12  # ... and backward wants it: copied back from staging, READY when the write ends
    STAGED_DROPPED = 13  # ... and no user left: release when the write ends

    NAMES = ("saved", "kept", "writing", "writing", "writing", "on_disk", "reading", "reading",
             "ready", "broken", "released", "writing", "writing", "writing")
    """What each state is in an error message (the dropped/wanted variants read as their IO)."""

    EXACT = ("SAVED", "KEPT", "WRITING", "WRITING_WANTED", "WRITE_DROPPED", "ON_DISK", "READING",
             "READ_DROPPED", "READY", "BROKEN", "RELEASED", "STAGED", "STAGED_WANTED", "STAGED_DROPPED")
    """Each state's own name (the table's messages)."""


S = State
# States in which the record holds the bytes in (device) memory.
RESIDENT = frozenset({S.SAVED, S.KEPT, S.WRITING, S.WRITING_WANTED, S.WRITE_DROPPED, S.READING,
                      S.READ_DROPPED, S.READY, S.STAGED_WANTED})
# States with IO in flight (the engine still uses the record's key and memory).
IN_FLIGHT = frozenset({S.WRITING, S.WRITING_WANTED, S.WRITE_DROPPED, S.READING, S.READ_DROPPED,
                       S.STAGED, S.STAGED_WANTED, S.STAGED_DROPPED})
WRITES = frozenset({S.WRITING, S.WRITING_WANTED, S.WRITE_DROPPED, S.STAGED, S.STAGED_WANTED,
                    S.STAGED_DROPPED})
STAGED_STATES = frozenset({S.STAGED, S.STAGED_WANTED, S.STAGED_DROPPED})
READS = frozenset({S.READING, S.READ_DROPPED})

# (from, to) -> what the step's counters record when it happens: "kept" (tensors_kept),
# "offloaded" (a write completed: tensors/bytes_offloaded), "fallback" (a write failed: the
# tensor stays in memory), "forwarded" (backward gets the in-memory tensor, no read),
# "taken_back" (a write not yet started was cancelled because backward wants the tensor),
# "held" (written, then found alive at backward: held by someone else, so written for nothing),
# "read" (bytes came back from the engine), "from_staging" (bytes came back from the write's
# host staging, not the engine: its drive write was still under way), "read_retried" (a
# failed read starts again),
# "written_forwarded" (written, but backward took the tensor from memory while the write was
# under way), "released_unread" (written, then released without a read: its graph was dropped,
# or the step ended without its backward), "written_modified" (written, but modified in place
# meanwhile: it cannot be read back). "held", "written_forwarded", "released_unread" and
# "written_modified" are the ways a written byte is wasted; the step's counters add each one up
# by the record's origin (``TensorRecord.origin``). Any pair not listed is a bug.
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
    (S.WRITING, S.STAGED): (),  # the device->host copy landed: the device memory goes
    (S.WRITE_DROPPED, S.STAGED_DROPPED): (),
    (S.STAGED, S.ON_DISK): ("offloaded",),
    (S.STAGED, S.STAGED_WANTED): ("from_staging", "forwarded"),  # copied back while the write runs
    (S.STAGED, S.READY): ("from_staging", "forwarded", "taken_back"),  # ... before it started: cancelled
    (S.STAGED, S.STAGED_DROPPED): (),
    (S.STAGED, S.KEPT): ("fallback", "kept"),  # the drive write failed: back from staging
    (S.STAGED, S.BROKEN): ("offloaded", "written_modified"),
    (S.STAGED, S.RELEASED): (),  # close() stopped waiting for a hung write
    (S.STAGED_WANTED, S.READY): ("offloaded", "written_forwarded"),
    (S.STAGED_WANTED, S.KEPT): ("fallback", "kept"),
    (S.STAGED_WANTED, S.RELEASED): (),
    (S.STAGED_DROPPED, S.STAGED): (),  # saved again (dedup) before its write completed
    (S.STAGED_DROPPED, S.ON_DISK): ("offloaded",),  # then released at once
    (S.STAGED_DROPPED, S.RELEASED): (),  # a queued write cancelled, a failed one, or close()
}


# The table as move() reads it: (from, to) -> (its effects, +1 when the record's bytes enter
# memory, -1 when they leave it, 0 otherwise): one lookup per transition on the hot path.
_MOVES: Dict[Tuple[int, int], Tuple[Tuple[str, ...], int]] = {
    (a, b): (effects, (b in RESIDENT) - (a in RESIDENT)) for (a, b), effects in TRANSITIONS.items()}


class IllegalTransition(RuntimeError):
    """A record was asked to go where ``TRANSITIONS`` does not allow: a bookkeeping bug in the
    offloader (the message names the record, both states and what the table allows)."""


def allowed_from(state: int) -> Tuple[str, ...]:
    """The states ``TRANSITIONS`` lets a record in ``state`` go to, by name."""
    return tuple(State.EXACT[b] for (a, b) in TRANSITIONS if a == state)


def move(rec, new: int, counters) -> None:
    """The one place a record (``cache/record.py``) changes state, and the one place the
    step's counters (``telemetry.stats.StepCounters``) follow what happened to a tensor.

    Raises:
        IllegalTransition: the table has no row for (the record's state, ``new``).
    """
    old = rec.state
    found = _MOVES.get((old, new))
    if found is None:
        allowed = ", ".join(allowed_from(old)) or "nothing"
        raise IllegalTransition(
            f"ssdtrain internal error: record {rec.id} ({rec.describe()}) cannot go from "
            f"{State.EXACT[old]} to {State.EXACT[new]}: the lifecycle table "
            f"(cache/lifecycle.py TRANSITIONS) allows {State.EXACT[old]} -> {allowed}")
    rec.state = new
    effects, resident = found
    if resident:
        counters.add_resident(rec.nbytes * resident)
    for e in effects:
        counters.count(e, rec.nbytes, rec.layer, rec.decision, rec)
