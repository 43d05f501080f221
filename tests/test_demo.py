"""The demo end to end, small: megatron-core GPT on CPU, offload vs keep, plot, no leftovers."""

import json
import os

from ssdtrain_megatron.cli import main


def test_demo_runs_end_to_end(tmp_path, capsys):
    d = tmp_path / "demo"
    rc = main(["demo", "--dir", str(d), "--steps", "2", "--layers", "2", "--hidden", "64",
               "--seq", "64", "--micro-batch-size", "2", "--micro-batches", "2"])
    out = capsys.readouterr()
    assert rc == 0, out
    assert "losses bitwise equal to keep: True" in out.out
    assert "peak resident activations: offload" in out.out
    assert "[########################] 2/2 step 2" in out.err
    png = d / "memory.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [f for _, _, fs in os.walk(d) for f in fs] == ["memory.png"]


def test_core_bench_json_has_pack_and_unpack_medians_per_policy(tmp_path, capsys):
    d = tmp_path / "bench"
    rc = main(["core-bench", "--dir", str(d), "--tensors", "60", "--tensor-kb", "16", "--steps", "1",
               "--json"])
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
