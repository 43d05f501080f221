"""What is left at a step's end, and what the warning says about it.

A record stays in the table until autograd drops its handle. Two ways one can still be there
when the step ends: its graph's backward did not run (the warning says so, naming where the
tensors came from), or a write raised in the pack hook, which then returned no handle for
autograd to drop: that record leaves at once, and nothing is left to warn about (issue 49:
a failed memory-tier write on the tiered engine warned "never released (a graph whose backward
did not run?)", which misdescribed it).
"""

from __future__ import annotations

import logging

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.io import make_engine
from tests.recording_streams import Recorder
from tests.test_staging_race import Logged, Saves

NBYTES = 64 * 1024


def _config(tmp_path, engine: str) -> OffloadConfig:
    return OffloadConfig(dirs=[str(tmp_path)], engine=engine, min_tensor_bytes=0, keep_last_layers=0,
                         host_memory_bytes=16 * NBYTES, pinned_staging_bytes=1 << 20)


@pytest.mark.parametrize("gpu_path", [False, True], ids=["cpu", "stand-in streams"])
def test_a_write_that_raises_in_pack_leaves_no_record_behind(tmp_path, caplog, gpu_path):
    """The tiered engine's memory-tier write raises (an engine bug: here a stand-in's): the
    caller gets the error, the record is released at once, the next step runs, and the step's
    end warns of nothing left behind. Broken variant: without the release in the pack hook's
    except path, end_step warns "1 saved tensors were still held by autograd"."""
    rec = Recorder()
    engine = Logged(make_engine(_config(tmp_path, "tiered")), rec, pooled=False)
    engine.refuse[0] = RuntimeError("stand-in engine bug")
    with ActivationOffloader(_config(tmp_path, "tiered"), device=torch.device("cpu"), engine=engine,
                             streams=rec if gpu_path else None) as off:
        x = torch.full((NBYTES // 4,), 1.0).requires_grad_()
        with caplog.at_level(logging.WARNING):
            with pytest.raises(RuntimeError, match="stand-in engine bug"):
                with off.microbatch(0):
                    Saves.apply(x, rec, [])
            assert len(off.table) == 0, "the record whose write raised is still in the table"
            off.end_step()
            seen = []
            with off.microbatch(0):
                y = Saves.apply(x, rec, seen)
            off.wait_writes()  # backward then reads it from the engine, not from memory
            y.sum().backward()
            stats = off.end_step()
    assert not [r for r in caplog.records if "still held by autograd" in r.getMessage()]
    assert stats.bytes_read == NBYTES, "the next step's tensor did not come back from the engine"
    assert torch.equal(seen[0].view(torch.int32), (x.detach() + 1).view(torch.int32))


def test_a_graph_whose_backward_did_not_run_is_named_at_the_steps_end(tmp_path, caplog):
    with ActivationOffloader(_config(tmp_path, "posix")) as off:
        x = torch.full((NBYTES // 4,), 1.0).requires_grad_()
        with off.microbatch(7):
            with off.layer(3):
                y = Saves.apply(x, Recorder(), [])
        with caplog.at_level(logging.WARNING):
            off.end_step()
        del y
    msg = [r.getMessage() for r in caplog.records if "still held by autograd" in r.getMessage()]
    assert msg and "micro-batch 7 layer 3 float32[16384]" in msg[0], msg
