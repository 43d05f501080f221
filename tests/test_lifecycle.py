"""The record lifecycle is one table (cache/lifecycle.py), and ``move`` enforces it.

Broken variant: ``move`` taking ``_MOVES.get((old, new), ((), 0))`` (no refusal): the first
two tests fail ("DID NOT RAISE IllegalTransition").
"""

import pytest
import torch

from ssdtrain_megatron.cache.lifecycle import (IN_FLIGHT, RESIDENT, STAGED_STATES, TRANSITIONS, IllegalTransition,
                                               State, allowed_from, move)
from ssdtrain_megatron.cache.record import TensorRecord
from ssdtrain_megatron.telemetry.stats import StepCounters


def _record(nbytes: int = 4096) -> TensorRecord:
    return TensorRecord(7, torch.zeros(nbytes // 4), microbatch=0, layer=3)


def test_reading_a_released_record_is_refused_with_the_tables_message():
    rec, c = _record(), StepCounters()
    move(rec, State.RELEASED, c)
    with pytest.raises(IllegalTransition) as info:
        move(rec, State.READING, c)
    msg = str(info.value)
    assert "record 7" in msg and "layer 3, micro-batch 0" in msg
    assert "cannot go from RELEASED to READING" in msg
    assert "allows RELEASED -> nothing" in msg
    assert rec.state == State.RELEASED  # refused: nothing changed


def test_a_refused_transition_names_what_the_table_allows_and_counts_nothing():
    rec, c = _record(), StepCounters()
    move(rec, State.WRITING, c)
    before = (c.resident_bytes, c.bytes_offloaded, c.tensors_offloaded)
    with pytest.raises(IllegalTransition, match="allows WRITING -> WRITING_WANTED, READY, ON_DISK"):
        move(rec, State.READING, c)
    assert (c.resident_bytes, c.bytes_offloaded, c.tensors_offloaded) == before


def test_the_counters_follow_the_tables_rows():
    """Written, read back, released: one offload, one read, and resident bytes only while the
    bytes are in memory (RESIDENT)."""
    rec, c = _record(4096), StepCounters()
    c.add_resident(rec.nbytes)  # the pack hook counts a new record resident
    for state in (State.WRITING, State.ON_DISK):
        move(rec, state, c)
    assert (c.tensors_offloaded, c.bytes_offloaded, c.resident_bytes) == (1, 4096, 0)
    for state in (State.READING, State.READY):
        move(rec, state, c)
    assert (c.bytes_read, c.resident_bytes) == (4096, 4096)
    move(rec, State.RELEASED, c)
    assert c.resident_bytes == 0 and c.peak_resident_bytes == 4096


def test_the_table_is_consistent():
    """Every row joins two states; a record can always be released (but once it is, nothing
    follows); the in-flight states hold their bytes in (device) memory, but for the STAGED
    ones, whose bytes are in host staging (a drive write after its copy landed), unless
    backward took a copy back (STAGED_WANTED)."""
    states = set(range(len(State.NAMES)))
    assert len(State.EXACT) == len(State.NAMES)
    assert all(a in states and b in states and a != b for a, b in TRANSITIONS)
    assert all((s, State.RELEASED) in TRANSITIONS for s in states - {State.RELEASED})
    assert allowed_from(State.RELEASED) == ()
    assert IN_FLIGHT - STAGED_STATES <= RESIDENT
    assert STAGED_STATES & RESIDENT == {State.STAGED_WANTED}


def _state_names(cell: str):
    """'WRITING, WRITING_WANTED' or 'ON_DISK (written)' as the states' names."""
    import re

    return [re.sub(r"\s*\(.*\)", "", n).strip() for n in cell.split(",")]


def _design_table():
    """The rows of docs/design.md's lifecycle table as {(from, to): counts}."""
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "design.md")
    text = open(path, encoding="utf-8").read()
    table = text[text.index("| from | to | when | counts |"):]
    rows = {}
    for line in table.splitlines()[2:]:
        if not line.startswith("|"):
            break
        froms, to, _, counts = (c.strip() for c in line.strip("|").split("|"))
        if froms.startswith("any but"):
            continue
        for a in _state_names(froms):
            for b in _state_names(to):
                rows[(getattr(State, a), getattr(State, b))] = \
                    {c.strip().replace(" ", "_") for c in counts.split(",") if c.strip()}
    return rows


def test_the_design_docs_table_says_what_each_row_counts():
    """docs/design.md's table, row by row, against TRANSITIONS (the transitions to RELEASED it
    folds into 'any but RELEASED' count nothing, but for ON_DISK's). Broken variant: drop
    'written_modified' from (WRITING, BROKEN) in lifecycle.py: "(WRITING, BROKEN): the docs
    count {'offloaded', 'written_modified'}, the code {'offloaded'}"."""
    docs = _design_table()
    assert len(docs) >= 20
    for (a, b), counts in docs.items():
        assert (a, b) in TRANSITIONS, (State.EXACT[a], State.EXACT[b])
        code = set(TRANSITIONS[(a, b)])
        assert counts == code, (f"({State.EXACT[a]}, {State.EXACT[b]}): the docs count {sorted(counts)}, "
                                f"the code {sorted(code)}")
    folded = [(a, b) for (a, b) in TRANSITIONS if (a, b) not in docs]
    assert all(b == State.RELEASED and not TRANSITIONS[(a, b)] for a, b in folded), folded
