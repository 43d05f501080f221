"""The happens-before chains of every offloaded tensor, read off the recorder's log
(tests/recording_streams.py): producer -> compaction -> device->host copy -> every disk write of
its key, and what ran on the allocating stream -> the disk read -> host->device copy -> scatter
-> the consumer in backward (test_device_copy.py's docstring says which rules and why). Apart
from the scenes that produce the log, so that any scene can be held to them."""

from __future__ import annotations

from typing import List, Optional

from tests.recording_streams import Node, Recorder, contains, overlaps


def _last_before(log: List[Node], idx: int, pred) -> Optional[Node]:
    for n in reversed(log[:idx]):
        if pred(n):
            return n
    return None


def _first_after(log: List[Node], idx: int, pred) -> Optional[Node]:
    for n in log[idx + 1:]:
        if pred(n):
            return n
    return None


def _hb(rec: Recorder, a: Node, b: Node, what: str) -> None:
    assert rec.happens_before(a, b), f"{what}: {a} is not ordered before {b}"


def _the_copy_out(rec: Recorder, w: Node) -> Node:
    """The device->host copy behind a write: for a staged one (``submit_write``) the last copy
    into its bytes before the last record of the event the engine got; for one into the
    memory engine's pool (``commit``) the first copy into the extent handed out for its key."""
    log, key = rec.log, w.tags["key"]
    if w.kind == "submit_write":
        ready = _last_before(log, w.idx, lambda n: n.kind == "record" and n.tags["event"] == w.tags["event"])
        assert ready is not None, f"key {key}: the engine got event {w.tags['event']}, never recorded"
        d2h = _last_before(log, ready.idx, lambda n: n.kind == "copy" and n.agent == ready.agent
                           and contains(n.tags["dst"], w.tags["ptr"]))
        assert d2h is not None, f"key {key}: no device->host copy into the staging before its event"
        return d2h
    view = _last_before(log, w.idx, lambda n: n.kind == "pool_view" and n.tags["key"] == key)
    assert view is not None, f"key {key}: committed without a pool extent"
    d2h = _first_after(log, view.idx, lambda n: n.kind == "copy" and contains(view.tags["ptr"], n.tags["dst"]))
    assert d2h is not None and d2h.idx < w.idx, f"key {key}: committed before any copy into its extent"
    _hb(rec, d2h, w, f"key {key}: the copy into the pool before its commit")
    return d2h


def check_write_chains(rec: Recorder, direct: bool, compute: str = "compute") -> int:
    """Every write (a submission, or a commit of a copy into the memory engine's pool):
    producer -> compaction -> D2H -> every disk (or pool) write of its key; and the device
    bytes the copy read are let go only after it ran (no record_stream needed). Returns how
    many."""
    log = rec.log
    writes = rec.nodes("submit_write") + rec.nodes("commit")
    for w in writes:
        key = w.tags["key"]
        disk = rec.nodes("disk_write", key=key)
        assert disk, f"key {key}: no chunk reached the engine's file or pool"
        if direct:
            src, last = w.tags["ptr"], None
        else:
            d2h = _the_copy_out(rec, w)
            assert d2h.agent != compute, f"key {key}: the copy ran on the compute stream"
            src, last = d2h.tags["src"], d2h
            gone = _first_after(log, d2h.idx, lambda n: n.kind == "let_go" and overlaps(n.tags["ptr"], src))
            if gone is not None:
                _hb(rec, d2h, gone, f"key {key}: device bytes let go before their copy ran")
        compact = _last_before(log, (last or w).idx, lambda n: n.kind == "compact" and contains(n.tags["dst"], src))
        producer = _last_before(log, (compact or last or w).idx,
                                lambda n: n.kind == "produce" and contains(n.tags["ptr"],
                                                                           compact.tags["src"] if compact else src))
        assert producer is not None, f"key {key}: no producer kernel wrote the bytes it stores"
        chain = [producer] + ([compact] if compact else []) + ([last] if last else [])
        for a, b in zip(chain, chain[1:]):
            _hb(rec, a, b, f"key {key} write")
        for d in disk:
            _hb(rec, chain[-1], d, f"key {key} write reaches the disk")
    return len(writes)


def check_read_chains(rec: Recorder, direct: bool, alloc_stream: str) -> int:
    """Every read (from the engine, or a copy straight out of the memory engine's pool):
    (disk read ->) allocation on the compute stream (``alloc_stream``, whose pool backward's
    frees went back to) -> H2D on the reload stream, ordered after the allocation -> scatter
    (compact) -> the consumer, which marks the tensor used by its stream if that is another
    one (gds: the allocating stream's past -> cuFile read -> scatter -> consumer). Returns how
    many."""
    log = rec.log
    reads = rec.nodes("submit_read") + rec.nodes("submit_pool_read")
    for r in reads:
        key = r.tags["key"]
        pooled = r.kind == "submit_pool_read"
        disk = [] if pooled else [n for n in rec.nodes("disk_read", key=key) if n.idx > r.idx]
        assert pooled or disk, f"key {key}: nothing was read back from the engine"
        if direct:
            past = _last_before(log, r.idx, lambda n: n.agent == alloc_stream and n.kind != "record")
            first_write, dst, final = disk, r.tags["ptr"], None
        else:
            past = None
            h2d = _first_after(log, r.idx, lambda n: n.kind == "copy" and contains(r.tags["ptr"], n.tags["src"]))
            assert h2d is not None, f"key {key}: no host->device copy out of its staging or pool extent"
            assert h2d.agent != alloc_stream, f"key {key}: the reload ran on the compute stream"
            alloc = _last_before(log, h2d.idx, lambda n: n.kind == "alloc" and contains(n.tags["ptr"], h2d.tags["dst"]))
            assert alloc is not None and alloc.agent == alloc_stream and alloc.idx > r.idx, \
                f"key {key}: the restored tensor was not allocated on the compute stream just before its copy: {alloc}"
            _hb(rec, alloc, h2d, f"key {key}: the reload copy before the compute stream reached the allocation")
            for d in disk:
                _hb(rec, d, alloc, f"key {key}: device memory taken before the disk read completed")
                _hb(rec, d, h2d, f"key {key}: disk read before the host->device copy")
            first_write, dst, final = [h2d], h2d.tags["dst"], h2d
        # A compact record's scatter follows at once: look no further than the next submission.
        anchor = (final or disk[-1]).idx
        bound = _first_after(log, anchor, lambda n: n.kind.startswith("submit_"))
        scatter = _first_after(log[:bound.idx] if bound else log, anchor,
                               lambda n: n.kind == "copy" and n.tags["src"] == dst
                               and (final is None or n.agent == final.agent))
        if scatter is not None:
            if final is not None:
                _hb(rec, final, scatter, f"key {key}: copy before scatter")
            else:
                for d in disk:
                    _hb(rec, d, scatter, f"key {key}: cuFile read before scatter")
            final, dst = scatter, scatter.tags["dst"]
        if past is not None:
            for n in first_write:
                _hb(rec, past, n, f"key {key}: memory reused before the allocating stream's earlier work")
        consumer = _first_after(log, (final or disk[-1]).idx,
                                lambda n: n.kind == "consume" and overlaps(n.tags["ptr"], dst))
        assert consumer is not None, f"key {key}: no consumer read the restored tensor"
        for n in ([final] if final is not None else disk):
            _hb(rec, n, consumer, f"key {key}: restored bytes before their consumer")
        if not direct and consumer.agent != alloc_stream:  # used by a stream other than its owner
            marked = _last_before(log, consumer.idx, lambda n: n.kind == "record_stream"
                                  and n.tags["stream"] == consumer.agent and overlaps(n.tags["ptr"], dst))
            assert marked is not None and marked.idx > final.idx, \
                f"key {key}: the restored tensor was not marked used by its consumer's stream"
    return len(reads)


# -- a model whose kernels the recorder sees ------------------------------------------------
