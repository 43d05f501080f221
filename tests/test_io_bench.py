"""``ssdtrain io-bench``: small runs (50 MiB) that check what it reports and how."""

from __future__ import annotations

import errno
import json
import os

import pytest

from ssdtrain_megatron.io import engine_class
from ssdtrain_megatron.tools import io_bench as bench
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
    assert set(report) == {"baseline", "engines", "tensor_mib", "page_cache_bypassed"}
    assert set(report["baseline"]) == {"write_gbps", "read_gbps"}
    assert set(report["engines"]) == {"posix"}
    figures = report["engines"]["posix"]
    assert set(figures) == {"write_gbps", "read_gbps", "write_ratio", "read_ratio", "cpu_us_per_tensor",
                            "write_gb_per_core_s", "read_gb_per_core_s"}
    assert all(v > 0 for v in list(figures.values()) + list(report["baseline"].values()))
    assert report["tensor_mib"] == 1
    assert report["page_cache_bypassed"] is _direct_io_works(tmp_path)


def test_progress_goes_to_stderr_and_only_the_json_to_stdout(tmp_path, capsys):
    rc, out, err = run_bench(["--dir", str(tmp_path), "--engine", "memory", "--json"] + SMALL, capsys)
    assert rc == 0
    json.loads(out)  # nothing else on stdout
    assert "[io-bench] round 1/1: baseline | memory | baseline" in err
    assert "[io-bench] memory write:" in err


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
    monkeypatch.setattr(bench, "raw_baseline", lambda *a, **k: pytest.fail("measured a baseline first"))
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


def test_each_engine_is_compared_with_the_baselines_measured_around_it(tmp_path, monkeypatch):
    calls = []
    speeds = iter([1.0, 3.0, 2.0, 4.0, 6.0, 2.0])  # baselines, in the order they are measured

    def fake_baseline(directory, total):
        v = next(speeds)
        calls.append(("baseline", v))
        return {"direct": True, "write_gbps": v, "read_gbps": v / 2}

    def fake_engine(name, directory, n, size, progress, base=None):
        calls.append((name, None))
        return {"write_gbps": 4.0, "read_gbps": 2.0, "write_cpu_s_per_gb": 0.1, "read_cpu_s_per_gb": 0.1,
                "write_call_us": 10.0, "read_call_us": 20.0, "cpu_us_per_tensor": 20.0,
                "write_gb_per_core_s": 2.0, "read_gb_per_core_s": 3.0,
                "page_cache_bypassed": True, "on_disk": True}

    monkeypatch.setattr(bench, "raw_baseline", fake_baseline)
    monkeypatch.setattr(bench, "bench_engine", fake_engine)
    report = bench.run(str(tmp_path), ["posix", "memory"], 1, 0.01, bench.Progress(False), rounds=2)
    # Round 1: B posix B memory B; round 2 starts with the other engine: B memory B posix B.
    assert [c[0] for c in calls] == ["baseline", "posix", "baseline", "memory", "baseline",
                                     "baseline", "memory", "baseline", "posix", "baseline"]
    # posix: 4 / mean(1, 3) = 2.0 in round 1; 4 / mean(6, 2) = 1.0 in round 2 -> median 1.5.
    assert report["engines"]["posix"]["write_ratio"] == pytest.approx(1.5)
    # memory: 4 / mean(3, 2) = 1.6; 4 / mean(4, 6) = 0.8 -> median 1.2.
    assert report["engines"]["memory"]["write_ratio"] == pytest.approx(1.2)
    assert report["baseline"]["write_gbps"] == pytest.approx(2.5)  # median of all six


def test_verify_off_and_crc32c_measures_each_engine_both_ways_and_reports_the_cost(tmp_path, capsys, monkeypatch):
    """``--verify off,crc32c``: posix and posix+crc32c in one run, the cost as ratios; only the
    crc32c contender checksums (the function is wrapped to count); memory has no file to
    verify and says so. Break: drop ``verify=v`` in io_bench._contenders -> 'checksummed
    bytes: 0'."""
    from ssdtrain_megatron.io import bounce  # where the engine checksums its chunks

    seen = {"posix": 0, "posix+crc32c": 0}
    current = []
    real_bench, real_crc = bench.bench_engine, bounce.checksum

    def counted_bench(name, directory, n, size, progress, base=None):
        current[:] = [bench.contender_label(name, base.verify)]
        return real_bench(name, directory, n, size, progress, base)

    def counted_crc(buf):
        seen[current[0]] += len(memoryview(buf).cast("B"))
        return real_crc(buf)

    monkeypatch.setattr(bench, "bench_engine", counted_bench)
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
