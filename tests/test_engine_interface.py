"""IOEngine declares everything the offloader reads or sets on an engine (ident, rank_dirs,
the meters, step_peak_bytes, tracer, device_direct), with defaults, so every engine, and every
wrapper around one, answers them without getattr/hasattr."""

from __future__ import annotations

import json

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.io import IOEngine, Identity, make_engine
from ssdtrain_megatron.io.base import BusyMeter
from tests.drives import mount

ENGINES = ["posix", "memory", "tiered", "posix@cap"]


@pytest.fixture(params=ENGINES)
def engine(request, tmp_path):
    name, _, cap = request.param.partition("@")
    cfg = OffloadConfig(dirs=mount(tmp_path / "ssd"), engine=name, job="t", host_memory_bytes=1 << 20,
                        bandwidth_cap_gbps=10.0 if cap else None)
    e = make_engine(cfg, Identity(rank=0, local_rank=0, hostname="h", job="t"))
    yield request.param, e
    e.close()


def test_every_engine_answers_what_the_offloader_asks(engine, tmp_path):
    name, e = engine
    assert isinstance(e, IOEngine)
    assert isinstance(e.device_direct, bool) and not e.device_direct
    assert isinstance(e.write_meter, BusyMeter) and isinstance(e.read_meter, BusyMeter)
    assert e.write_meter is e.write_meter  # one meter per engine, not one per look-up
    assert e.tracer is None
    if name == "memory":  # no files: the declared defaults
        assert (e.ident, list(e.rank_dirs), e.step_peak_bytes) == (None, [], None)
    else:
        assert e.ident.rank == 0 and e.ident.job == "t"
        assert len(e.rank_dirs) == 1 and e.rank_dirs[0].startswith(str(tmp_path / "ssd") + "/")
        assert e.step_peak_bytes == [0]
    data = torch.arange(5000, dtype=torch.int32).view(torch.uint8)
    e.write(1, data).result(30)
    out = torch.empty_like(data)
    e.read(1, out).result(30)
    assert torch.equal(out, data)
    assert e.write_meter.take()[0] == data.numel() and e.read_meter.take()[0] == data.numel()


def test_a_tracer_set_on_a_wrapped_engine_reaches_the_engine_that_does_the_io(engine):
    name, e = engine
    seen = []
    e.tracer = lambda op, key, *rest: seen.append((op, key))
    e.write(7, torch.ones(100, dtype=torch.uint8)).result(30)
    e.read(7, torch.empty(100, dtype=torch.uint8)).result(30)
    assert seen == [("write", 7), ("read", 7)], name


def test_the_io_trace_is_written_under_a_bandwidth_cap(tmp_path):
    """Before IOEngine declared ``tracer``, the offloader set it on the ThrottledEngine itself,
    and the engine under it never traced anything."""
    trace = tmp_path / "trace.jsonl"
    cfg = OffloadConfig(dirs=mount(tmp_path / "ssd"), min_tensor_bytes=0, keep_last_layers=0,
                        trace_path=str(trace), bandwidth_cap_gbps=10.0)
    lin = torch.nn.Linear(64, 64)
    with ActivationOffloader(cfg, device=torch.device("cpu")) as off:
        with off.microbatch(0):
            out = lin(torch.randn(32, 64)).sin()
        off.wait_writes()  # so that backward reads (an in-flight write is forwarded from memory)
        out.sum().backward()
        st = off.end_step()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert st.bytes_offloaded > 0 and st.bytes_read > 0
    assert sum(r["bytes"] for r in rows if r["op"] == "write") == st.bytes_offloaded
    assert sum(r["bytes"] for r in rows if r["op"] == "read") == st.bytes_read
