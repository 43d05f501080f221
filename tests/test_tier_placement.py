"""The runtime follows the plan's places (issue 35, part 4): the tiered engine stores a key where
the offloader places it ('host' or 'ssd'), never over host memory; the decisions 'host' and
'ssd' reach it per layer; bandwidth_cap_gbps slows only the SSD tier; StepStats says the bytes
of each tier. Real engines on real files (tmp_path); gradients compared as integer views."""

from __future__ import annotations

import queue
import time

import pytest
import torch

from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.cache import ActivationOffloader
from ssdtrain_megatron.io import EngineError, make_engine
from ssdtrain_megatron.io.layout import Identity
from ssdtrain_megatron.io.posix import PosixEngine
from ssdtrain_megatron.io.throttle import ThrottledEngine
from ssdtrain_megatron.io.tiered import TieredEngine
from tests.bitwise import bitwise_equal

MiB = 1 << 20


def _engine(tmp_path, **overrides):
    cfg = OffloadConfig(dirs=[str(tmp_path)], engine="tiered", **overrides)
    return make_engine(cfg, Identity(rank=0, local_rank=0, hostname="host", job="test"))


def test_a_key_placed_on_ssd_never_takes_host_memory(tmp_path):
    """Broken by ignoring the hint in write(): tier_of(1) == 'memory'."""
    engine = _engine(tmp_path, host_memory_bytes=8 * MiB)
    try:
        src = torch.arange(MiB, dtype=torch.uint8)
        engine.place(1, "ssd")
        engine.write(1, src).result(30)
        assert engine.tier_of(1) == "posix" and engine.bytes_in_memory == 0
        out = torch.empty_like(src)
        engine.read(1, out).result(30)
        assert torch.equal(out, src)
        engine.write(2, src).result(30)  # not placed: host memory first, as before plans
        assert engine.tier_of(2) == "memory" and engine.tensors_spilled == 0
    finally:
        engine.close()


def test_a_key_placed_on_host_goes_to_ssd_only_when_host_memory_is_full(tmp_path):
    """Broken by raising PoolFull for a key placed on host: the third write fails."""
    engine = _engine(tmp_path, host_memory_bytes=2 * MiB)
    try:
        for key in range(3):
            engine.place(key, "host")
            engine.write(key, torch.full((MiB,), key, dtype=torch.uint8)).result(30)
        assert [engine.tier_of(k) for k in range(3)] == ["memory", "memory", "posix"]
        assert engine.bytes_in_memory <= 2 * MiB
        assert (engine.host_spilled, engine.tensors_spilled) == (1, 1)
    finally:
        engine.close()


def test_pool_view_is_refused_for_a_key_placed_on_ssd_and_a_wrong_place_is_an_error(tmp_path):
    """The GPU path asks pool_view before write: an 'ssd' key must not reserve host memory.
    Broken by dropping the placement check in pool_view: a view is returned."""
    engine = _engine(tmp_path, host_memory_bytes=8 * MiB)
    try:
        engine.place(1, "ssd")
        assert engine.pool_view(1, MiB) is None and engine.bytes_in_memory == 0
        engine.place(2, "host")
        assert engine.pool_view(2, MiB) is not None
        with pytest.raises(EngineError, match=r"tier 'disk' of key 3 is invalid: expected one of host, ssd"):
            engine.place(3, "disk")
        engine.release(1)
        engine.release(2)
        assert engine.bytes_on_disk == 0
    finally:
        engine.close()


def test_bandwidth_cap_slows_only_the_ssd_tier_of_tiered(tmp_path):
    """make_engine puts the cap on tiered's SSD tier alone (not around the whole engine), and
    the throttle then reports to the tiered engine's completions queue. Broken by wrapping
    tiered in the throttle again in make_engine: the engine is a ThrottledEngine."""
    cap = 0.02  # GB/s: 1 MiB takes >= 52 ms on the emulated drive
    engine = _engine(tmp_path, host_memory_bytes=4 * MiB, bandwidth_cap_gbps=cap)
    try:
        assert isinstance(engine, TieredEngine) and isinstance(engine.ssd, ThrottledEngine)
        assert isinstance(engine.ssd.inner, PosixEngine)
        done: "queue.SimpleQueue" = queue.SimpleQueue()
        engine.completions = done
        src = torch.ones(MiB, dtype=torch.uint8)
        engine.place(1, "ssd")
        t0 = time.perf_counter()
        assert engine.write(1, src) is None
        assert done.get(timeout=30) == (1, None)
        assert time.perf_counter() - t0 >= MiB / (cap * 1e9) * 0.99
        engine.write(2, src)  # host memory: no cap
        assert done.get(timeout=30) == (2, None)
        meters = engine.tier_meters()
        (ssd_bytes, ssd_busy), (host_bytes, _) = meters["ssd"][0].take(), meters["host"][0].take()
        assert (ssd_bytes, host_bytes) == (MiB, MiB) and ssd_busy >= MiB / (cap * 1e9) * 0.99
    finally:
        engine.close()


def test_the_throttle_reports_to_a_completions_queue(tmp_path):
    """Broken by returning the Future in completions mode: write() is not None and nothing
    reaches the queue."""
    cfg = OffloadConfig(dirs=[str(tmp_path)], bandwidth_cap_gbps=1.0)
    engine = make_engine(cfg, Identity(rank=0, local_rank=0, hostname="host", job="test"))
    try:
        done: "queue.SimpleQueue" = queue.SimpleQueue()
        engine.completions = done
        assert engine.write(7, torch.ones(4096, dtype=torch.uint8)) is None
        assert done.get(timeout=30) == (7, None)
        out = torch.empty(4096, dtype=torch.uint8)
        assert engine.read(7, out) is None and done.get(timeout=30) == (7, None)
        assert torch.equal(out, torch.ones(4096, dtype=torch.uint8))
        engine.release(7)
    finally:
        engine.close()


# -- the offloader's decisions -------------------------------------------------------------------


def _train(off, weights, x, decisions):
    """One step of a 3-layer tanh MLP under ``off`` (None: no offloader); (grads, stats)."""
    for k, d in decisions.items():
        off.set_layer_decision(k, d)
    x = x.detach().requires_grad_(True)
    with off.microbatch(0):
        h = x
        for i, w in enumerate(weights):
            with off.layer(i):
                h = torch.tanh(h @ w)
    off.wait_writes()  # every write lands (none taken back by a backward that came first)
    h.sum().backward()
    return [w.grad.clone() for w in weights] + [x.grad.clone()], off.end_step()


def test_each_layer_goes_to_the_tier_its_decision_names_and_gradients_are_bitwise_equal(tmp_path):
    """Layers 0 and 2 on 'host', layer 1 on 'ssd': the tiers' bytes in StepStats are those
    layers' bytes, bytes are read back, and the gradients equal keep's bit for bit.
    Broken by not calling engine.place() in the submit path: host holds all of it (host bytes
    == every layer's, ssd 0)."""
    torch.manual_seed(0)
    weights = [(torch.randn(256, 256) * 0.05).requires_grad_(True) for _ in range(3)]
    x = torch.randn(512, 256)
    cfg = OffloadConfig(dirs=[str(tmp_path)], engine="tiered", host_memory_bytes=64 * MiB,
                        min_tensor_bytes=4096, keep_last_layers=0)
    with ActivationOffloader(cfg.replace(policy="keep")) as keep:
        want, _ = _train(keep, weights, x, {})
    for w in weights:
        w.grad = None
    with ActivationOffloader(cfg) as off:
        got, stats = _train(off, weights, x, {0: "host", 1: "ssd", 2: "host"})
        assert off.engine.tensors_spilled == 0
    by_layer = {r.layer: r for r in stats.layers}
    assert [by_layer[k].decision for k in ("0", "1", "2")] == ["host", "ssd", "host"]
    assert stats.tier_bytes["host"] == by_layer["0"].bytes + by_layer["2"].bytes
    assert stats.tier_bytes["ssd"] == by_layer["1"].bytes > 0
    assert stats.tier_bytes["host"] + stats.tier_bytes["ssd"] == stats.bytes_offloaded
    assert stats.bytes_read > 0 and stats.tier_bytes["keep"] == 0
    assert set(stats.tier_gbps) == {"host", "ssd"} and stats.tier_gbps["ssd"]["write"] > 0
    assert "; tiers: keep 0.0 MB, host " in stats.summary() and ", ssd " in stats.summary()
    assert all(bitwise_equal(a, b) for a, b in zip(got, want))


def test_a_single_tier_engine_reports_its_one_tier_and_refuses_unknown_places(tmp_path):
    """posix is one tier, 'ssd'; 'host' and 'ssd' are offloads to it. Broken by leaving
    'host' out of cache/decisions.py DECISIONS: ValueError for 'host'."""
    torch.manual_seed(0)
    weights = [(torch.randn(128, 128) * 0.05).requires_grad_(True) for _ in range(3)]
    cfg = OffloadConfig(dirs=[str(tmp_path)], min_tensor_bytes=4096, keep_last_layers=0)
    with ActivationOffloader(cfg) as off:
        _, stats = _train(off, weights, torch.randn(256, 128), {0: "host", 1: "keep", 2: "offload"})
        with pytest.raises(ValueError, match=r"decision='disk' is invalid; allowed: offload, keep, "
                                             r"recompute, host, ssd"):
            off.set_layer_decision(0, "disk")
    by_layer = {r.layer: r for r in stats.layers}
    assert set(stats.tier_bytes) == {"keep", "ssd"} and set(stats.tier_gbps) == {"ssd"}
    assert stats.tier_bytes["ssd"] == by_layer["0"].bytes + by_layer["2"].bytes
    assert stats.tier_bytes["keep"] == by_layer["1"].bytes > 0


def test_on_the_gpu_path_a_layer_placed_on_ssd_is_staged_and_one_on_host_copied_into_the_pool(tmp_path):
    """The GPU data path with the recording stand-in for CUDA streams (no CUDA here): host
    memory has room for every layer, yet layer 0, placed on 'ssd', goes through the pinned
    staging to the drive, and layers 1 and 2, placed on 'host', are copied straight into the
    host tier's pool; gradients bitwise equal. Broken by dropping the placement check in
    TieredEngine.pool_view: layer 0 is copied into the pool too (no staged copy)."""
    from tests.recording_streams import Recorder, _range
    from tests.test_memory_tier_direct import LAYERS, NBYTES, _copies, _reference, _run
    from tests.test_staging_race import Logged, check_staging_reuse

    config = OffloadConfig(dirs=[str(tmp_path)], engine="tiered", min_tensor_bytes=0, keep_last_layers=0,
                           prefetch_layers=LAYERS, chunk_bytes=64 * 1024, max_inflight_bytes=1 << 20,
                           pinned_staging_bytes=1 << 20, host_memory_bytes=4 * LAYERS * NBYTES)
    rec = Recorder()
    engine = Logged(make_engine(config), rec)
    with ActivationOffloader(config, device=torch.device("cpu"), engine=engine, streams=rec) as off:
        for layer, place in {0: "ssd", 1: "host", 2: "host"}.items():
            off.set_layer_decision(layer, place)
        pool, staging = _range(engine.inner.memory._pool), _range(off._copy.pool._mem)
        grads, stats = _run(off, rec)
        check_staging_reuse(rec, engine.inner.memory._pool)
        check_staging_reuse(rec, off._copy.pool._mem)
    for a, b in zip(grads, _reference(), strict=True):
        assert bitwise_equal(a, b)
    assert len(_copies(rec, "dst", staging)) == 2  # layer 0 of each micro-batch
    assert len(_copies(rec, "dst", pool)) == 4  # layers 1 and 2 of each
    assert stats.tier_bytes == {"keep": 0, "host": 4 * NBYTES, "ssd": 2 * NBYTES}


def test_policy_offload_on_tiered_places_the_last_layers_on_host_and_the_first_on_ssd(tmp_path):
    """No plan given: the first step goes first-come (host memory fills with the first layers,
    the issue's complaint), then each layer is placed by the bytes that step measured: the last
    layer on host (host memory holds one), the ones before it on SSD. Broken by not calling
    TierPlacement.learn at the step's end: step 2 is first-come again (layer 0 on host)."""
    torch.manual_seed(0)
    weights = [(torch.randn(256, 256) * 0.05).requires_grad_(True) for _ in range(3)]
    x = torch.randn(512, 256)
    layer = 512 * 256 * 4
    cfg = OffloadConfig(dirs=[str(tmp_path)], engine="tiered", host_memory_bytes=layer + 4096,
                        min_tensor_bytes=4096, keep_last_layers=0)
    with ActivationOffloader(cfg) as off:
        _, first = _train(off, weights, x, {})
        for w in weights:
            w.grad = None
        got, second = _train(off, weights, x, {})
    assert [r.decision for r in first.layers] == ["offload"] * 3
    assert first.tier_bytes["host"] == layer  # first come: layer 0
    assert [r.decision for r in second.layers] == ["ssd", "ssd", "host"]
    assert second.tier_bytes["host"] == layer and second.tier_bytes["ssd"] == 2 * layer
    for w in weights:
        w.grad = None
    with ActivationOffloader(cfg.replace(policy="keep")) as keep:
        want, _ = _train(keep, weights, x, {})
    assert all(bitwise_equal(a, b) for a, b in zip(got, want))
