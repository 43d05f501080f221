"""OffloadConfig.io_cpus: every IO thread confines itself to those CPUs when it starts (the
bench's node emulation puts IO on a core of its own); CPUs the process may not use are refused
where the engine is built. Real engines and threads; the affinity is read back from Linux."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.config import ConfigError
from ssdtrain_megatron.io import EngineUnavailable, make_engine
from ssdtrain_megatron.io.affinity import allowed_cpus
from ssdtrain_megatron.io.layout import Identity

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                                reason="needs Linux affinity and two CPUs")

IDENT = Identity(rank=0, local_rank=0, hostname="host", job="test")


def _affinities(threads):
    return {t.name: os.sched_getaffinity(t.native_id) for t in threads}


def test_every_io_thread_runs_on_io_cpus(tmp_path):
    """posix and memory workers and the throttle's thread (started later, by the training
    thread) all run on the one CPU given. Broken by dropping pin_io_thread from the throttle's
    ThreadPoolExecutor initializer: the throttle thread has every CPU."""
    cpu = max(os.sched_getaffinity(0))
    cfg = OffloadConfig(dirs=[str(tmp_path)], engine="tiered", io_cpus=[cpu], host_memory_bytes=1 << 20,
                        bandwidth_cap_gbps=10.0)
    engine = make_engine(cfg, IDENT)
    try:
        engine.place(1, "ssd")
        engine.write(1, torch.ones(1 << 16, dtype=torch.uint8)).result(30)  # starts the throttle's thread
        found = _affinities(engine.ssd.inner._workers + engine.memory._workers
                            + list(engine.ssd._pool._threads))  # this engine's threads only
        for kind in ("ssdtrain-io-", "ssdtrain-mem-", "ssdtrain-throttle"):
            assert any(n.startswith(kind) for n in found), sorted(found)
        assert all(cpus == {cpu} for cpus in found.values()), found
        assert len(os.sched_getaffinity(0)) > 1  # the calling thread keeps its CPUs
        engine.release(1)
    finally:
        engine.close()


def test_io_cpus_the_process_may_not_use_are_refused_naming_the_ones_it_may(tmp_path):
    """Broken by skipping check_cpus in make_engine: no error (the threads log a warning)."""
    bad = (os.cpu_count() or 1) + 7
    with pytest.raises(EngineUnavailable, match=rf"io_cpus \[{bad}\]: CPU\(s\) \[{bad}\] are not among the "
                                                r"CPUs this process may use \(\d"):
        make_engine(OffloadConfig(dirs=[str(tmp_path)], io_cpus=[bad]), IDENT)


def test_allowed_cpus_sees_the_process_not_a_confined_thread():
    """A training thread confined to one CPU (the bench's node emulation) still lets the IO
    threads use the others. Broken by returning os.sched_getaffinity(0): only the one CPU."""
    everything = os.sched_getaffinity(0)
    seen = []

    def confined() -> None:
        os.sched_setaffinity(0, {min(everything)})
        seen.append(allowed_cpus())

    t = threading.Thread(target=confined)
    t.start()
    t.join()
    assert seen == [everything]


def test_io_cpus_must_be_cpu_numbers():
    with pytest.raises(ConfigError, match=r"OffloadConfig.io_cpus=\[-1\] is invalid: expected a list of "
                                          r"CPU numbers >= 0"):
        OffloadConfig(io_cpus=[-1])
    assert OffloadConfig(io_cpus=(0, 1)).io_cpus == [0, 1]
