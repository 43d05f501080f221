"""``ssdtrain io-bench``: small runs (50 MiB) that check what it reports and how."""

from __future__ import annotations

import errno
import json
import os

import pytest

from ssdtrain_megatron.io import engine_class
from ssdtrain_megatron.tools.iobench import cli as bench
from ssdtrain_megatron.tools.iobench.measure import Segment
from tests.cli_helpers import run_cli

SMALL = ["--tensor-mib", "1", "--total-gib", "0.05", "--rounds", "1"]


def run_bench(argv, capsys):
    return run_cli(["io-bench"] + argv, capsys)


def _direct_io_works(path) -> bool:
    probe = os.path.join(path, "probe")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    os.unlink(probe)
    return True


def test_json_has_exactly_the_documented_shape_with_positive_figures(tmp_path, capsys):
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "posix", "--json"] + SMALL, capsys)
    assert rc == 0, err
    report = json.loads(out)
    assert set(report) == {"baseline", "engines", "tensor_mib", "page_cache_bypassed", "method"}
    assert set(report["baseline"]) == {"write_gbps", "read_gbps"}
    assert set(report["engines"]) == {"posix"}
    figures = report["engines"]["posix"]
    scalars = {"write_gbps", "read_gbps", "write_ratio", "read_ratio", "cpu_us_per_tensor",
               "write_gb_per_core_s", "read_gb_per_core_s"}
    assert set(figures) == scalars | {"write_ratio_rounds", "read_ratio_rounds", "segments"}
    assert all(figures[k] > 0 for k in scalars) and all(v > 0 for v in report["baseline"].values())
    assert len(figures["write_ratio_rounds"]) == len(figures["read_ratio_rounds"]) == 1
    assert report["method"] == {"order": "ABBA", "segments_per_side": 2, "segment_mib": 26,
                                "space": "fresh, preallocated"}  # 51 tensors of 1 MiB: 26 + 25
    assert report["tensor_mib"] == 1
    assert report["page_cache_bypassed"] is _direct_io_works(tmp_path)


def test_progress_goes_to_stderr_and_only_the_json_to_stdout(tmp_path, capsys):
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "memory", "--json"] + SMALL, capsys)
    assert rc == 0
    json.loads(out)  # nothing else on stdout
    assert "[io-bench] round 1/1: memory: 1 x (baseline memory memory baseline)" in err
    assert "[io-bench] memory: write " in err


def test_table_shows_the_baseline_and_each_engine_with_ratios(tmp_path, capsys):
    rc, out, _ = run_bench(["--dir", str(tmp_path), "--engine", "memory", "--quiet"] + SMALL, capsys)
    assert rc == 0
    lines = out.splitlines()
    assert any(line.startswith("raw O_DIRECT") for line in lines)
    assert any(line.startswith("memory ") for line in lines)
    assert "ratio" in out and "write() us" in out
    assert "51 tensors x 1 MiB" in out  # 0.05 GiB = 51.2 MiB


def test_all_skips_an_engine_that_cannot_run_and_says_why(tmp_path, capsys, monkeypatch):
    from ssdtrain_megatron.io import aio

    monkeypatch.setattr(aio, "aio_unavailable_reason", lambda: "libaio-dev is missing (test)")
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "all", "--json"] + SMALL, capsys)
    assert rc == 0
    assert set(json.loads(out)["engines"]) == {"posix", "memory"}
    assert "skipping aio: libaio-dev is missing (test)" in err


def test_an_engine_asked_for_by_name_that_cannot_run_fails_with_the_reason(tmp_path, capsys):
    ok, why = engine_class("gds").is_available()
    if ok:
        pytest.skip("gds can run here")
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "gds", "--quiet"] + SMALL, capsys)
    assert rc == 1 and out == ""
    assert err.startswith("ssdtrain io-bench: --engine gds: cannot run here: ") and len(err.splitlines()) == 1, err


def test_layout_comparison_reports_slab_and_file_per_tensor(tmp_path, capsys):
    rc, out, _ = run_bench(["--dir", str(tmp_path), "--engine", "memory", "--json", "--quiet",
                            "--compare-layout"] + SMALL, capsys)
    assert rc == 0
    layout = json.loads(out)["layout"]
    assert layout["slab"]["write_gbps"] > 0 and layout["slab"]["read_gbps"] > 0
    assert layout["file_per_tensor"]["write_gbps"] > 0 and layout["file_per_tensor"]["read_gbps"] > 0


def test_nothing_is_left_in_the_directory(tmp_path, capsys):
    (tmp_path / "mine.txt").write_text("keep me")
    rc, _, _ = run_bench(["--dir", str(tmp_path), "--engine", "posix", "--quiet", "--compare-layout"] + SMALL,
                         capsys)
    assert rc == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine.txt"]


def test_wrong_bytes_read_back_fail_the_run(tmp_path, capsys, monkeypatch):
    from ssdtrain_megatron.io.memory import MemoryEngine

    monkeypatch.setattr(MemoryEngine, "_copy_out", lambda self, out, offset, nbytes: out.zero_())
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "memory", "--quiet"] + SMALL, capsys)
    assert rc == 1 and out == ""
    assert "returned wrong bytes" in err


@pytest.mark.parametrize("argv, message", [
    (["--total-gib", "0"], "ssdtrain io-bench: error: argument --total-gib: expected a number > 0, got '0'"),
    (["--total-gb", "-1"], "ssdtrain io-bench: error: argument --total-gb: expected a number > 0, got '-1'"),
    (["--rounds", "0"], "ssdtrain io-bench: error: argument --rounds: expected a positive integer, got 0"),
    (["--set", "io_threads"], "ssdtrain io-bench: --set 'io_threads': expected FIELD=VALUE"),
    (["--set", "io_threads=0"], "ssdtrain io-bench: OffloadConfig.io_threads=0 is invalid"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, argv, message):
    rc, out, err = run_bench(["--dir", str(tmp_path), "--quiet"] + argv, capsys)
    assert rc == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(message), err


def test_old_unit_spellings_still_work_and_say_they_are_deprecated(tmp_path, capsys):
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "memory", "--json", "--quiet",
                              "--tensor-mb", "1", "--total-gb", "0.01", "--rounds", "1"], capsys)
    assert rc == 0, err
    assert json.loads(out)["tensor_mib"] == 1.0
    assert "--tensor-mb is deprecated, use --tensor-mib" in err
    assert "--total-gb is deprecated, use --total-gib" in err


def test_an_engine_that_cannot_run_fails_before_any_measurement(tmp_path, capsys, monkeypatch):
    """--engine aio without libaio: one line, exit 1, and no baseline measured first."""
    from ssdtrain_megatron.io import aio

    monkeypatch.setattr(aio.AioEngine, "is_available", classmethod(lambda cls: (False, "libaio-dev is missing (test)")))
    monkeypatch.setattr(bench, "BaselineSide", lambda *a, **k: pytest.fail("measured a baseline first"))
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "aio"] + SMALL, capsys)
    assert rc == 1 and out == ""
    assert err == ("ssdtrain io-bench: --engine aio: cannot run here: libaio-dev is missing (test) "
                   "(ssdtrain doctor lists what runs here)\n")


def test_config_fields_can_be_set_for_the_engines(tmp_path, capsys):
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "posix", "--json", "--set", "io_threads=2",
                              "--set", "chunk_bytes=1048576"] + SMALL, capsys)
    assert rc == 0, err
    assert json.loads(out)["engines"]["posix"]["write_gbps"] > 0


@pytest.mark.aio
def test_aio_is_measured_against_the_same_baseline(tmp_path, capsys):
    ok, why = engine_class("aio").is_available()
    if not ok:
        pytest.skip(f"engine 'aio' cannot run here: {why}")
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "aio", "--json"] + SMALL, capsys)
    assert rc == 0, err
    figures = json.loads(out)["engines"]["aio"]
    assert figures["write_gbps"] > 0 and figures["read_gbps"] > 0 and figures["cpu_us_per_tensor"] > 0


class _FakeBaseline:
    """Stands in for iobench.measure.BaselineSide: each segment takes the next of ``times``."""

    def __init__(self, calls, times):
        self.calls, self.times, self.direct = calls, times, True

    def segment(self, directory, nbytes):
        self.calls.append(("baseline", nbytes))
        t = next(self.times)
        return Segment(nbytes, t, t)

    def close(self):
        pass


class _FakeEngine:
    """Stands in for iobench.engine_side.EngineSide: each step takes the next of ``times``."""

    def __init__(self, calls, times, name, tensor_bytes):
        self.calls, self.times, self.label, self.tensor_bytes = calls, times, name, tensor_bytes
        self.memory, self.page_cache_bypassed = None, True

    def step(self, n):
        self.calls.append((self.label, n * self.tensor_bytes))
        t = next(self.times)
        return Segment(n * self.tensor_bytes, t, t, calls=n)

    def close(self):
        pass


def test_each_round_takes_turns_baseline_engine_engine_baseline_and_sums_bytes_and_seconds(tmp_path, monkeypatch):
    """Per round and engine: ABBA quads, rounds starting with another engine; each side's
    bytes over its summed seconds, the ratio of those. Broken variant: each side's GB/s as the
    mean of its segments' -> posix round 1: 1.21, not 8/6."""
    calls = []
    # Seconds per segment, in the order measured: round 1 posix (B E E B B E E B), memory
    # (same), round 2 memory, posix. Every segment moves 2 MiB.
    times = iter([2, 1, 3, 4,  1, 1, 1, 1,
                  1, 2, 2, 1,  1, 1, 1, 1,
                  1, 1, 1, 1,  1, 1, 1, 1,
                  4, 2, 2, 4,  4, 2, 2, 4])
    monkeypatch.setattr(bench, "BaselineSide", lambda memory: _FakeBaseline(calls, times))
    monkeypatch.setattr(bench, "EngineSide", lambda name, d, size, n, progress, cfg: _FakeEngine(calls, times, name,
                                                                                                 size))
    report = bench.run(str(tmp_path), ["posix", "memory"], 1, 8 / 1024, bench.Progress(False), rounds=2,
                       segment_mib=2)
    quad = lambda n: ["baseline", n, n, "baseline"] * 2  # noqa: E731 - 8 tensors of 1 MiB, 2 MiB segments
    assert [c[0] for c in calls] == quad("posix") + quad("memory") + quad("memory") + quad("posix")
    assert {c[1] for c in calls} == {2 << 20}
    posix = report["engines"]["posix"]
    # round 1: engine 8 MiB in 1+3+1+1 = 6 s, baseline in 2+4+1+1 = 8 s -> 8/6; round 2: 8/8 vs 16/16 -> 2.
    assert posix["write_ratio_rounds"] == pytest.approx([8 / 6, 2.0])
    assert posix["write_ratio"] == pytest.approx((8 / 6 + 2.0) / 2)  # median of two
    assert report["engines"]["memory"]["read_ratio_rounds"] == pytest.approx([4 / 6, 1.0])  # 6 s vs 4 s; 1 vs 1
    assert [s["side"] for s in posix["segments"][0]] == quad("engine")
    assert posix["segments"][0][1]["write_gbps"] == pytest.approx((2 << 20) / 1e9)  # 2 MiB in 1 s


def test_verify_off_and_crc32c_measures_each_engine_both_ways_and_reports_the_cost(tmp_path, capsys, monkeypatch):
    """``--verify off,crc32c``: posix and posix+crc32c in one run, the cost as ratios; only the
    crc32c contender checksums (the function is wrapped to count); memory has no file to
    verify and says so. Break: drop ``verify=v`` in iobench.cli._contenders -> 'checksummed
    bytes: 0'."""
    from ssdtrain_megatron.io import bounce  # where the engine checksums its chunks

    seen = {"posix": 0, "posix+crc32c": 0}
    current = []
    real_side, real_crc = bench.EngineSide, bounce.checksum

    def counted_side(name, directory, size, n, progress, base=None):
        current[:] = [bench.contender_label(name, base.verify)]
        return real_side(name, directory, size, n, progress, base)

    def counted_crc(buf):
        seen[current[0]] += len(memoryview(buf).cast("B"))
        return real_crc(buf)

    monkeypatch.setattr(bench, "EngineSide", counted_side)
    monkeypatch.setattr(bounce, "checksum", counted_crc)
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "posix", "--json", "--verify",
                              "off,crc32c"] + SMALL, capsys)
    assert rc == 0, err
    report = json.loads(out)
    assert set(report["engines"]) == {"posix", "posix+crc32c"}
    assert seen["posix"] == 0 and seen["posix+crc32c"] > 0, f"checksummed bytes: {seen}"
    cost = report["verify_cost"]["posix+crc32c"]
    assert set(cost) == {f"{op}_{k}_ratio" for op in ("write", "read") for k in ("gbps", "gb_per_core_s")}
    e = report["engines"]
    assert cost["write_gbps_ratio"] == e["posix+crc32c"]["write_gbps"] / e["posix"]["write_gbps"]
    assert cost["read_gb_per_core_s_ratio"] == \
        e["posix+crc32c"]["read_gb_per_core_s"] / e["posix"]["read_gb_per_core_s"]

    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "memory", "--quiet", "--verify",
                              "off,crc32c"] + SMALL, capsys)
    assert rc == 0 and "memory+crc32c skipped: engine='memory' keeps tensors in host RAM" in out
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "memory", "--quiet", "--verify",
                              "crc32c"] + SMALL, capsys)
    assert rc == 2 and err.startswith("ssdtrain io-bench: nothing to measure: memory+crc32c: "), err


def _real_run(tmp_path, monkeypatch, record, **kwargs):
    """bench.run on the real filesystem with the posix engine, 64 tensors of 1 MiB, 2 segments
    a side; ``record(phase, ...)`` hooks; returns (report, the EngineSides built)."""
    sides = []
    real_side, real_round = bench.EngineSide, bench.measure_round
    phase = ["warm-up"]

    def side(*args, **kw):
        sides.append(real_side(*args, **kw))
        return sides[-1]

    def measured(*args, **kw):
        phase[0] = "measured"
        try:
            return real_round(*args, **kw)
        finally:
            phase[0] = "warm-up"

    monkeypatch.setattr(bench, "EngineSide", side)
    monkeypatch.setattr(bench, "measure_round", measured)
    record(phase)
    report = bench.run(str(tmp_path), ["posix"], 1, 1 / 16, bench.Progress(False), segment_mib=32, **kwargs)
    return report, sides


def test_every_segment_of_both_sides_writes_into_a_new_file_reserved_at_once(tmp_path, monkeypatch):
    """Both sides into fresh preallocated space, as a training step writes (the slab is removed
    at the end of every step): each baseline segment and each measured engine step reserve
    their file in one fallocate at its start, while it holds no block. The engine's first step
    (growing the slab by GROW_BYTES) is the untimed warm-up. Broken variants: no warm-up step in
    EngineSide -> a measured slab reservation at an offset past 0; Slab.end_step forgetting
    ``expected`` -> the same."""
    from ssdtrain_megatron.io import slab

    monkeypatch.setattr(slab, "GROW_BYTES", 1 << 20)
    calls = []
    real = os.posix_fallocate

    def record(phase):
        def fallocate(fd, offset, length):
            held = os.fstat(fd).st_blocks
            calls.append((phase[0], os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, held))
            return real(fd, offset, length)

        monkeypatch.setattr(os, "posix_fallocate", fallocate)

    report, _ = _real_run(tmp_path, monkeypatch, record, rounds=2)
    assert report["method"]["segments_per_side"] == 2
    measured = [c for c in calls if c[0] == "measured"]
    assert [c[1] for c in measured] == ["baseline.bin", "slab.bin", "slab.bin", "baseline.bin"] * 2, measured
    assert {(c[2], c[3]) for c in measured} == {(0, 0)}, measured  # at the file's start, no block held
    assert any(c[0] == "warm-up" and c[2] > 0 for c in calls)  # the warm-up grew its slab


def test_the_baseline_moves_each_block_through_the_memory_the_engine_uses_for_those_bytes(tmp_path, monkeypatch):
    """How large the requests reaching a drive are depends on the memory's physical layout
    (iobench.measure.BenchMemory), so the baseline writes segment byte ``o`` from where the engine
    keeps tensor byte ``o`` (source ``o // T % n``) and reads it into where the engine reads it.
    Broken variant: BenchMemory.window ignoring the offset -> every block from the first
    source."""
    import ctypes

    from ssdtrain_megatron.tools.iobench import measure as io_measure

    seen = []
    real_do = io_measure._do

    def record(phase):
        def do(op, fd, mv, offset, path):
            probe = ctypes.c_char.from_buffer(mv)
            seen.append((op, ctypes.addressof(probe), offset))
            del probe  # releases the export before the baseline releases ``mv``
            return real_do(op, fd, mv, offset, path)

        monkeypatch.setattr(io_measure, "_do", do)

    _, sides = _real_run(tmp_path, monkeypatch, record)
    size = 1 << 20
    sources, outs = sides[0].sources, sides[0].outs
    assert len(sources) == 32 and len(outs) == 32  # the baseline's 8 x 8 MiB, 32 tensors a segment
    want = [(op, (sources if op == "write" else outs)[off // size % 32].data_ptr() + off % size, off)
            for op in ("write", "read") for off in range(0, 32 * size, 8 << 20)]
    assert sorted(seen) == sorted(want * 2)  # one round: 2 baseline segments of 32 MiB
