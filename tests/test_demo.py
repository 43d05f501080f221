"""The demo end to end, small: megatron-core GPT on CPU, offload vs keep, plot, no leftovers."""

import json
import os

import pytest

from ssdtrain_megatron.tools.cli import main


def test_demo_runs_end_to_end(tmp_path, capsys):
    d = tmp_path / "demo"
    rc = main(["demo", "--dir", str(d), "--steps", "2", "--num-layers", "2", "--hidden-size", "64",
               "--seq-length", "64", "--micro-batch-size", "2", "--num-microbatches", "2",
               "--min-tensor-bytes", "4KiB"])
    out = capsys.readouterr()
    assert rc == 0, out
    lines = out.out.splitlines()
    assert "losses bitwise equal to keep: True" in lines
    # Offload really happened: bytes went to the drive and came back.
    saved = next(ln for ln in lines if ln.startswith("offloaded to SSD: "))
    written, read = (float(saved.split()[i]) for i in (3, 6))
    assert written > 0 and read > 0, saved
    assert any(ln.startswith("peak resident activations, last step (the plot): offload ") for ln in lines)
    assert any(ln.startswith("where the time went, per step: offload ") for ln in lines)
    assert any(ln.startswith("diagnosis: ") for ln in lines)
    # The header names every setting that changes the numbers.
    header = out.out.split("\n\n")[0]
    for setting in ("engine posix", "io_threads 4", "chunk_bytes 8.0 MiB", "verify off",
                    "min_tensor_bytes 4.0 KiB", "keep_last_layers 1", "prefetch_layers 2", " free of ",
                    "OpenMP wait policy: "):
        assert setting in header, setting
    # Per-step lines on stderr; no progress bar (not a terminal), no megatron-core noise.
    assert "step 1/2 (warm-up): loss " in out.err and "step 2/2: loss " in out.err
    assert "it/s" not in out.err and "Apex" not in out.err and "Transformer Engine" not in out.err
    png = d / "memory.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [f for _, _, fs in os.walk(d) for f in fs] == ["memory.png"]


def test_the_demos_loss_comparison_is_bitwise_step_for_step():
    """Broken variant: the comparison as it was (``==`` on the float losses): 0.0 equals -0.0,
    a nan loss in both runs differs, and this fails at the first assertion."""
    from ssdtrain_megatron.tools.demo import losses_bitwise_equal

    assert not losses_bitwise_equal([(0.0,)], [(-0.0,)])
    nan = float("nan")
    assert losses_bitwise_equal([(1.5,), (nan,)], [(1.5,), (nan,)])
    assert not losses_bitwise_equal([(1.5,), (2.0,)], [(1.5,)])  # a step missing
    assert not losses_bitwise_equal([(1.0,)], [(1.0 + 2 ** -52,)])


def test_core_bench_json_has_pack_and_unpack_medians_per_policy(tmp_path, capsys):
    d = tmp_path / "bench"
    rc = main(["core-bench", "--dir", str(d), "--tensors", "60", "--tensor-kib", "16", "--steps", "1",
               "--rounds", "1", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    result = json.loads(out.out)
    assert set(result["pack_us"]) == {"pass_through", "keep", "offload"}
    assert set(result["unpack_us"]) == {"keep", "offload"}
    assert all(v > 0 for v in [*result["pack_us"].values(), *result["unpack_us"].values()]), result
    assert (result["tensors"], result["tensor_kb"]) == (60, 16)
    # Every offloaded tensor but the warm-up one was unpacked from bytes read back.
    assert result["offload_bytes_read"] >= 59 * 16 * 1024
    assert 0 < result["peak_resident_ratio"] < 1
    assert [f for _, _, fs in os.walk(d) for f in fs] == []
    assert "sweep" not in result
    assert result["rounds"] == 1 and set(result["gap_us"]) == {"pack", "unpack"}
    # One round: keep, offload, offload, keep; the gap is offload's mean minus keep's.
    assert result["gap_us"]["pack"] == pytest.approx(result["pack_us"]["offload"] - result["pack_us"]["keep"])


def test_core_bench_gap_pairs_each_round_keep_offload_offload_keep():
    from ssdtrain_megatron.tools.bench.corebench import _round_gaps

    runs = {"keep": [(10.0, 5.0), (12.0, 7.0), (20.0, 9.0), (22.0, 9.0)],
            "offload": [(13.0, 8.0), (15.0, 8.0), (21.0, 20.0), (23.0, 20.0)]}
    # Round 1: offload 14 against keep 11; round 2: 22 against 21 (the machine slowed in between).
    assert _round_gaps(runs, 0) == [3.0, 1.0]
    assert _round_gaps(runs, 1) == [2.0, 11.0]


def test_core_bench_refuses_zero_rounds(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["core-bench", "--dir", str(tmp_path), "--rounds", "0"])
    assert "expected a positive integer, got 0" in capsys.readouterr().err


def test_core_bench_sweep_reports_flatness_over_tensor_counts(tmp_path, capsys):
    d = tmp_path / "bench"
    rc = main(["core-bench", "--dir", str(d), "--tensors", "20", "--tensor-kib", "8", "--steps", "1",
               "--sweep", "20,40", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    sweep = json.loads(out.out)["sweep"]
    assert set(sweep["pack_us"]) == set(sweep["unpack_us"]) == {"20", "40"}
    assert all(v > 0 for v in [*sweep["pack_us"].values(), *sweep["unpack_us"].values()]), sweep
    assert sweep["flatness"]["pack"] == sweep["pack_us"]["40"] / sweep["pack_us"]["20"]
    assert sweep["flatness"]["unpack"] == sweep["unpack_us"]["40"] / sweep["unpack_us"]["20"]


def test_core_bench_sweep_refuses_a_single_count(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["core-bench", "--dir", str(tmp_path), "--sweep", "1000"])
    assert exc.value.code == 2
    assert "two or more tensor counts" in capsys.readouterr().err
