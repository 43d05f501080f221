"""The engine suite (tests/test_engines.py), part: what is particular to one engine: the memory
and tiered engines, DeepNVMe's (aio) traps, gds and the engine settings in the config.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from ssdtrain_megatron.config import ENGINES, ConfigError, OffloadConfig
from ssdtrain_megatron.io import EngineError, EngineUnavailable, engine_class

import tests.test_engines as engine_suite
from tests.test_engines import CHUNK, _files_under, _round_trip, _skip_unless_available

from tests.test_engine_round_trip import ODD_SIZES

open_engine = engine_suite.open_engine  # the engine suite's fixture


# -- memory and tiered --------------------------------------------------------------------------


def test_memory_pool_full_raises_naming_host_memory_bytes_and_the_way_out(open_engine):
    from ssdtrain_megatron.io.memory import PoolFull

    engine = open_engine("memory", host_memory_bytes=2 * CHUNK)
    engine.write(0, torch.ones(CHUNK, dtype=torch.uint8)).result(30)
    with pytest.raises(PoolFull, match=r"host_memory_bytes=131072.*engine='tiered'"):
        engine.write(1, torch.ones(2 * CHUNK, dtype=torch.uint8))
    engine.release(0)
    assert engine.write(1, torch.ones(2 * CHUNK, dtype=torch.uint8)).result(30) == 2 * CHUNK


def test_memory_pool_holds_its_capacity(open_engine):
    engine = open_engine("memory")
    assert engine._pool.numel() == engine.capacity


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: without it the pool is never "
                    "pinned and the check would compare False with False")
def test_memory_pool_is_pinned_where_cuda_exists(open_engine):
    """``pinned`` is defined as "CUDA exists"; what can go wrong is the pool itself."""
    engine = open_engine("memory")
    assert engine.pinned and engine._pool.is_pinned()


def test_memory_engine_creates_no_files(open_engine):
    engine = open_engine("memory")
    _round_trip(engine, [torch.ones(CHUNK, dtype=torch.uint8)])
    assert all(_files_under(r) == [] for r in engine.test_roots)


def test_tiered_fills_memory_first_then_spills_to_ssd(open_engine):
    engine = open_engine("tiered", host_memory_bytes=2 * CHUNK)
    tensors = [torch.full((CHUNK,), i, dtype=torch.uint8) for i in range(4)]
    outs = _round_trip(engine, tensors)
    assert [engine.tier_of(i) for i in range(4)] == ["memory", "memory", "posix", "posix"]
    assert engine.tensors_spilled == 2
    # on the SSD, each in a page more: room for a shift (io/bounce.py)
    assert engine.bytes_in_memory == 2 * CHUNK and engine.bytes_on_ssd == 2 * (CHUNK + 4096)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))
    engine.release(0)
    engine.write(9, tensors[0]).result(30)  # freed memory is used again
    assert engine.tier_of(9) == "memory"


# -- aio: DeepNVMe's traps ----------------------------------------------------------------------


@pytest.mark.aio
@pytest.mark.parametrize("parallelism", [2, 3])
def test_aio_pads_requests_to_a_multiple_of_intra_op_parallelism(open_engine, parallelism):
    engine = open_engine("aio", n_roots=2, aio_intra_op_parallelism=parallelism, aio_block_bytes=8192)
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in ODD_SIZES]
    outs = _round_trip(engine, tensors)
    assert all(torch.equal(o, t) for o, t in zip(outs, tensors))


@pytest.mark.aio
def test_aio_first_writes_from_many_lanes_at_once_do_not_deadlock(tmp_path):
    # DeepNVMe's first write runs a std::call_once that takes the GIL; the engine makes that
    # write alone in its constructor. Only a fresh process shows the race.
    _skip_unless_available("aio")
    code = f"""
import torch
from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.io import make_engine
e = make_engine(OffloadConfig(dirs=[{str(tmp_path)!r}], engine="aio", io_threads=8, chunk_bytes=65536))
futs = [e.write(i, torch.full((8 * 65536,), i, dtype=torch.uint8)) for i in range(4)]
assert [f.result(60) for f in futs] == [8 * 65536] * 4
e.close()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.aio
def test_aio_read_with_the_wrong_size_is_refused(open_engine):
    engine = open_engine("aio")
    engine.write(0, torch.ones(1000, dtype=torch.uint8)).result(30)
    with pytest.raises(EngineError, match="into 999 bytes; 1000 were written"):
        engine.read(0, torch.empty(999, dtype=torch.uint8))


def test_aio_availability_names_every_missing_piece(monkeypatch):
    from ssdtrain_megatron.io import aio, aio_support

    monkeypatch.setattr(aio_support, "_prebuilt_op", lambda ds_dir: False)
    monkeypatch.setattr(aio_support, "_has_libaio_dev", lambda: False)
    monkeypatch.setattr(aio_support.shutil, "which", lambda name: None)
    if aio_support.importlib.util.find_spec("deepspeed") is not None:
        why = aio_support.aio_unavailable_reason()
        assert "libaio-dev" in why and "C++ compiler" in why and "ninja" in why
    real_find_spec = aio_support.importlib.util.find_spec
    monkeypatch.setattr(aio_support.importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real_find_spec(name, *a))
    ok, why = aio.AioEngine.is_available()
    assert not ok and "pip install deepspeed==0.19.8" in why


def test_a_build_lock_left_by_a_killed_build_is_refused_not_waited_on(tmp_path, monkeypatch, caplog):
    import logging

    from ssdtrain_megatron.io import aio_support

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = aio_support.build_lock_path()
    assert lock == str(tmp_path / "async_io" / "lock")
    aio_support.check_build_lock(lock)  # no lock: nothing to say
    (tmp_path / "async_io" / "lock").touch()
    caplog.set_level(logging.WARNING, logger="ssdtrain_megatron")
    aio_support.check_build_lock(lock)  # a build is running: wait for it, and say so
    assert any("another process is building" in r.getMessage() for r in caplog.records)
    old = time.time() - 3600
    for entry in (tmp_path / "async_io").iterdir():
        os.utime(entry, (old, old))
    os.utime(tmp_path / "async_io", (old, old))
    with pytest.raises(EngineUnavailable, match=r"nothing in its directory has changed for 60 min.*rm .*async_io/lock"):
        aio_support.check_build_lock(lock)


def test_asking_whether_aio_can_run_neither_imports_deepspeed_nor_builds():
    code = ("import sys; from ssdtrain_megatron.io import engine_class; "
            "engine_class('aio').is_available(); engine_class('gds').is_available(); "
            "assert 'deepspeed' not in sys.modules and 'kvikio' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# -- gds and config -----------------------------------------------------------------------------


def test_every_configurable_engine_has_a_class_named_after_it():
    for name in ENGINES:
        assert engine_class(name).name == name
    with pytest.raises(EngineUnavailable, match="unknown engine 'nvme'"):
        engine_class("nvme")


def test_gds_refuses_checksums_it_could_not_compute():
    assert OffloadConfig(engine="gds").engine == "gds"  # the config probes nothing (test_capability.py)
    with pytest.raises(ConfigError, match=r"OffloadConfig.verify='crc32c'.*engine='gds'.*'posix' or 'aio'"):
        OffloadConfig(engine="gds", verify="crc32c")


def test_memory_refuses_checksums_it_would_not_compute():
    with pytest.raises(ConfigError, match=r"OffloadConfig.verify='crc32c'.*engine='memory'.*engine='tiered'"):
        OffloadConfig(engine="memory", host_memory_bytes=1 << 20, verify="crc32c")
    assert OffloadConfig(engine="tiered", verify="crc32c").verify == "crc32c"


@pytest.mark.parametrize("field, value, message", [
    ("aio_block_bytes", 5000, "multiple of 4096"),
    ("aio_block_bytes", 0, "integer >= 4096"),
    ("aio_queue_depth", 0, "integer >= 1"),
    ("aio_intra_op_parallelism", True, "integer >= 1"),
    ("host_memory_bytes", -1, "integer >= 0"),
])
def test_config_rejects_bad_engine_settings_naming_the_field(field, value, message):
    with pytest.raises(ConfigError, match=rf"OffloadConfig.{field}=.*{message}"):
        OffloadConfig(**{field: value})


def test_memory_engine_needs_a_pool():
    with pytest.raises(ConfigError, match="host_memory_bytes=0.*engine='memory'"):
        OffloadConfig(engine="memory", host_memory_bytes=0)
