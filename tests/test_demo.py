"""The demo end to end, small: megatron-core GPT on CPU, offload vs keep, plot, no leftovers."""

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


def test_core_bench_measures_the_pack_hook(tmp_path):
    from ssdtrain_megatron.config import OffloadConfig
    from ssdtrain_megatron.corebench import hook_cost_us

    cfg = OffloadConfig(dirs=[str(tmp_path)])
    costs = {p: hook_cost_us(cfg, p, 200, 16 * 1024) for p in ("pass-through", "keep", "offload")}
    assert all(0 < us < 100_000 for us in costs.values()), costs
    assert os.listdir(tmp_path) == []
