"""The pinned staging pool (cache/staging.py) and its settings: allocated once, never blocking
the caller, reclaimed by event queries, a clear error when pinned memory cannot be had. The
streams are the recording stand-in (tests/recording_streams.py)."""

from __future__ import annotations

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache.staging import StagingPool, StagingUnavailable
from ssdtrain_megatron.config import ConfigError
from ssdtrain_megatron.io import make_engine
from tests.recording_streams import Recorder
from tests.test_device_copy import _config


def test_staging_pool_is_allocated_once_and_overflows_without_blocking(caplog):
    rec = Recorder()
    pool = StagingPool(8192, rec)
    a = pool.take(5000)
    assert a.offset == 0 and pool.bytes_in_use == 8192  # blocks are whole pages (zero-copy O_DIRECT)
    b = pool.take(3000)  # does not fit: an overflow block, not a wait
    assert b.offset is None and pool.overflows == 1 and b.tensor.numel() == 3000
    ev = rec.new_event()
    # The copy out of it has not run: its event recorded on a stream the host does not see
    # finish (CUDA answers done for an event never recorded).
    behind = rec.new_stream(torch.device("cpu"))
    rec.unobserved.add(behind.name)
    ev.record(behind)
    pool.give(a, after=ev)
    c = pool.take(1500)
    assert c.offset is None and pool.overflows == 2
    rec.unobserved.discard(behind.name)
    rec.run_all()  # the stream ran to the event
    d = pool.take(5000)  # the event completed: the block is reclaimed (by query, never a wait)
    assert d.offset == 0
    assert not rec.nodes("synchronize") and rec.nodes("query_done")


def test_pinned_memory_that_cannot_be_had_is_a_clear_error(tmp_path):
    config = _config(tmp_path, "posix", pinned_staging_bytes=1 << 20)
    engine = make_engine(config)
    with pytest.raises(StagingUnavailable, match=r"pinned_staging_bytes=1048576 .*ulimit -l"):
        ActivationOffloader(config, device=torch.device("cpu"), engine=engine,
                            streams=Recorder(pin_fails=True))
    engine.close()


def test_pinned_staging_bytes_is_validated_and_defaults_from_max_inflight_bytes(tmp_path):
    assert OffloadConfig(dirs=[str(tmp_path)], max_inflight_bytes=3 << 20).staging_bytes() == 6 << 20
    assert OffloadConfig(dirs=[str(tmp_path)], pinned_staging_bytes=5000).staging_bytes() == 5000
    for bad in (0, -1, True, "1G", 1.5):
        with pytest.raises(ConfigError, match=r"OffloadConfig.pinned_staging_bytes=.* expected an integer >= 1"):
            OffloadConfig(dirs=[str(tmp_path)], pinned_staging_bytes=bad)


def test_pinned_staging_bytes_has_a_flag():
    import argparse

    from ssdtrain_megatron.megatron.args import add_ssd_offload_args, config_from_args

    parser = add_ssd_offload_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--ssd-offload", "--ssd-offload-pinned-staging-bytes", "65536"])
    assert config_from_args(ns).pinned_staging_bytes == 65536
    with pytest.raises(SystemExit):
        parser.parse_args(["--ssd-offload", "--ssd-offload-pinned-staging-bytes", "0"])


def test_cpu_device_without_streams_keeps_the_direct_path(tmp_path):
    with ActivationOffloader(_config(tmp_path, "posix"), device=torch.device("cpu")) as off:
        assert off.copy is None
