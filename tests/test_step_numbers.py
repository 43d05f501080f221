"""The numbers a user reads: StepStats.summary(), the stats JSONL, step_time_s, trace times."""

import json
import time

import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from tests.faulty import faulty_offloader
from tests.models import mlp, run_steps


def cfg(d, **kw):
    kw.setdefault("min_tensor_bytes", 1024)
    return OffloadConfig(dirs=[str(d)], **kw)


def test_summary_names_fallbacks_when_writes_failed(offload_dir):
    with faulty_offloader(cfg(offload_dir)) as off:
        off.engine.fault = lambda op, path, offset, nbytes: OSError(28, "No space left on device") if op == "write" else None
        # Waited for: a failed write is only counted once the IO thread has tried it.
        _, _, stats = run_steps(mlp(), [torch.randn(16, 256)], off, steps=1, wait_writes=True)
    st = stats[-1]
    assert st.fallbacks > 0 and st.bytes_offloaded == 0
    assert f"{st.fallbacks} FALLBACKS (writes that failed and stayed in memory)" in st.summary()


def test_summary_is_silent_about_fallbacks_when_there_are_none(offload_dir):
    with ActivationOffloader(cfg(offload_dir)) as off:
        _, _, stats = run_steps(mlp(), [torch.randn(16, 256)], off, steps=1, wait_writes=True)
    assert stats[-1].fallbacks == 0 and stats[-1].bytes_offloaded > 0
    assert "FALLBACK" not in stats[-1].summary()


def test_summary_counts_what_is_warned_about_once_per_job():
    """The warnings for a failed write, a retried read and a budget overrun come once per job;
    the step line counts them every step. Broken variant (read_retries left out of summary()):
    the line ends "1 FALLBACK (...), 2 BUDGET OVERRUNS" and the endswith assertion fails."""
    import dataclasses

    from ssdtrain_megatron.telemetry.stats import StepStats

    needed = {f.name: 0 for f in dataclasses.fields(StepStats)
              if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    line = StepStats(**dict(needed, fallbacks=1, read_retries=3, budget_overruns=2)).summary()
    assert line.endswith("peak resident 0.0 MB, 1 FALLBACK (writes that failed and stayed in "
                         "memory), 3 READ RETRIES, 2 BUDGET OVERRUNS")
    assert "RETR" not in StepStats(**needed).summary() and "OVERRUN" not in StepStats(**needed).summary()


def test_two_offloaders_sharing_a_stats_file_are_told_apart(offload_dir, tmp_path):
    """The demo's keep and offload write one file: each line says its policy and iteration."""
    path = tmp_path / "steps.jsonl"
    offs = {p: ActivationOffloader(cfg(offload_dir, policy=p, stats_path=str(path))) for p in ("keep", "offload")}
    try:
        for _ in range(2):
            for off in offs.values():
                # wait_writes: a write not yet started when backward releases its tensor is
                # cancelled, and this tiny model's backward can come that soon.
                run_steps(mlp(), [torch.randn(16, 256)], off, steps=1, wait_writes=True)
    finally:
        for off in offs.values():
            off.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["run"]["policy"] for r in lines if "run" in r] == ["keep", "offload"]  # one header each
    rows = [r for r in lines if "run" not in r]
    assert [(r["policy"], r["step"], r["iteration"]) for r in rows] == [
        ("keep", 0, 1), ("offload", 0, 1), ("keep", 1, 2), ("offload", 1, 2)]
    assert all(r["bytes_offloaded"] == 0 for r in rows if r["policy"] == "keep")
    assert all(r["bytes_offloaded"] > 0 for r in rows if r["policy"] == "offload")


def test_step_time_starts_at_the_first_forward_not_at_the_last_end_step(offload_dir):
    """Time spent between steps (another model's step, the optimizer, start-up) is not in
    step_time_s; iteration_time_s has it. Bounds by the wall clock around each call, so a
    loaded machine cannot make this fail."""
    model, x = mlp(), torch.randn(16, 256)
    with ActivationOffloader(cfg(offload_dir)) as off:
        time.sleep(0.6)  # between construction and the first step
        t0 = time.perf_counter()
        run_steps(model, [x], off, steps=1)
        first_wall = time.perf_counter() - t0
        first = off.last_step_stats
        time.sleep(0.6)  # between steps
        t0 = time.perf_counter()
        run_steps(model, [x], off, steps=1)
        second_wall = time.perf_counter() - t0
        second = off.last_step_stats
    assert 0 < first.step_time_s <= first_wall and 0 < second.step_time_s <= second_wall
    assert first.iteration_time_s == first.step_time_s  # the first iteration starts at its forward
    assert second.iteration_time_s >= 0.6 + second.step_time_s  # the pause between steps counts


def test_trace_records_carry_a_wall_clock_time(offload_dir, tmp_path):
    trace = tmp_path / "trace.jsonl"
    before = time.time()
    with ActivationOffloader(cfg(offload_dir, trace_path=str(trace))) as off:
        run_steps(mlp(), [torch.randn(16, 256)], off, steps=1, wait_writes=True)
    after = time.time()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert rows and all(before <= r["wall"] <= after for r in rows)
    assert all(abs((r["wall"] - rows[0]["wall"]) - (r["t"] - rows[0]["t"])) < 1e-3 for r in rows)


def test_an_offloader_says_where_its_bytes_go_and_warns_about_ram(tmp_path, caplog):
    """/tmp/ssdtrain (the default) may be tmpfs: the offloader says so when it starts."""
    import logging
    import os

    from ssdtrain_megatron.io.where import filesystem_of

    with caplog.at_level(logging.INFO, logger="ssdtrain_megatron.io.roots"):
        with ActivationOffloader(cfg(tmp_path)) as off:
            d = off.rank_dirs[0]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any(m.startswith(f"ssdtrain: offload files in {d}: ") and " free of " in m for m in infos), infos
    assert ("ssdtrain: engine posix, policy offload, min_tensor_bytes 1.0 KiB, keep_last_layers 1, "
            "prefetch_layers 2, io_threads 4, chunk_bytes 8.0 MiB, max_inflight_bytes 1.0 GiB, "
            "verify off") in infos, infos
    if filesystem_of(str(tmp_path))[0] not in ("tmpfs", "ramfs"):
        # Only the system-disk warning (io/roots.py), where tmp_path is on the filesystem of /.
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        on_system = os.stat(tmp_path).st_dev == os.stat("/").st_dev
        assert warned == ([f"ssdtrain: offload directory {d} is on the same filesystem as / "
                           f"({filesystem_of(d)[1]}): filling it can stop the machine; put the roots on "
                           "node-local NVMe (--ssd-offload-dir)"] if on_system else []), warned
    if os.path.isdir("/dev/shm") and filesystem_of("/dev/shm")[0] == "tmpfs":
        caplog.clear()
        root = f"/dev/shm/ssdtrain-test-{os.getpid()}"
        os.mkdir(root)  # a root must exist (io/roots.py)
        try:
            with caplog.at_level(logging.WARNING, logger="ssdtrain_megatron.io.roots"):
                ActivationOffloader(cfg(root)).close()
        finally:
            os.rmdir(root)
        assert any("is in RAM (tmpfs), not on an SSD" in r.getMessage() for r in caplog.records)


def _need_after_full_disk(offload_dir, limit):
    """What the free-space check says the next step needs, after a step on a 'disk' where every
    write past ``limit`` bytes fails with ENOSPC (None: no limit)."""
    from tests.models import tiny_gpt

    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 256, (2, 64), generator=g) for _ in range(3)]
    with faulty_offloader(cfg(offload_dir, chunk_bytes=64 * 1024)) as off:
        if limit is not None:
            off.engine.fault = (lambda op, path, offset, nbytes: OSError(28, "No space left on device")
                                if op == "write" and offset + nbytes > limit else None)
        # Every write runs before backward: one taken back would never take an extent, and the
        # high-water mark would depend on how far the IO threads had got.
        _, _, stats = run_steps(tiny_gpt(), batches, off, steps=1, wait_writes=True)
        return list(off.engine.step_peak_bytes), stats[-1].fallbacks


def test_the_space_the_next_step_needs_does_not_depend_on_how_full_the_disk_was(offload_dir):
    """A write that failed keeps its extent until its tensor is released, as a successful one
    does: the slab's high-water mark is the step's demand, the same on any disk."""
    need, fallbacks = _need_after_full_disk(offload_dir, None)
    assert fallbacks == 0 and need[0] > 0
    for limit in (64 * 1024, need[0] // 2):
        got, fell = _need_after_full_disk(offload_dir, limit)
        assert fell > 0
        assert got == need, (limit, got, need)
