"""`ssdtrain doctor --node-profile OUT.yaml`: this machine measured into a NodeProfile the
planner loads (the drive under a real root, host memory, on this CPU-only machine the CPU's
stand-ins, named in ``source``). Small measurement sizes; the GPU figures need a GPU."""

from __future__ import annotations

import json
import os

import pytest

from ssdtrain_megatron.plan.node import load_profile
from ssdtrain_megatron.tools import cpu_adam, node_profile


def _doctor(argv):
    from ssdtrain_megatron.tools.cli import main

    return main(["doctor", *argv])


@pytest.fixture
def small(monkeypatch):
    monkeypatch.setattr(node_profile, "DRIVE_BYTES", 16 << 20)
    monkeypatch.setattr(node_profile, "COPY_BYTES", 8 << 20)
    monkeypatch.setattr(node_profile, "REPEATS", 2)
    monkeypatch.setattr(cpu_adam, "PARAMS", 1 << 16)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU's stand-ins")
def test_the_profile_doctor_writes_loads_and_says_what_stands_in_for_the_gpu(tmp_path, small, capsys):
    """Broken by writing the drive's read figure as its write figure in measure_node: the
    profile's drive_write_gbps is the read one (not the median of the write measurements).
    The host memory bus is the copy counted both ways (broken by leaving it out of the
    profile: None, the plan would not check the bus)."""
    root = tmp_path / "nvme"
    root.mkdir()
    out = tmp_path / "node.yaml"
    calls = []
    real = node_profile.measure_drives

    def spy(roots, nbytes=None):
        got = real(roots, nbytes)
        calls.append(got)
        return got

    node_profile.measure_drives = spy
    try:
        rc = _doctor(["--dir", str(root), "--node-profile", str(out), "--json"])
    finally:
        node_profile.measure_drives = real
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    json.loads(captured.out)  # stdout stays one JSON object
    node = load_profile(str(out))
    drive = calls[0]
    assert (node.drives, node.gpus_per_node) == (1, 1)
    assert node.drive_write_gbps == round(drive["write_gbps"], 3) > 0
    assert node.drive_read_gbps == round(drive["read_gbps"], 3) > 0
    assert node.gpu_tflops > 0 and node.host_link_gbps > 0 and node.host_memory_bytes > 0
    assert "no GPU, the CPU trains" in node.source and "drive_tbw_tb ASSUMED" in node.source
    assert node.host_memory_gbps is not None and node.host_memory_gbps > 0
    # both rounded to 3 decimals (0.0005 each): on a loaded machine the copy is under 1 GB/s
    assert node.host_memory_gbps == pytest.approx(2 * node.host_link_gbps, abs=1.5e-3)
    assert node.host_copy_gbps == pytest.approx(node.host_link_gbps, abs=1e-3)  # one "GPU"
    assert "host_memory_gbps" in node.source
    # the CPU optimizer rate (issue 67): measured on the one rank's cores, bounded by the bus
    # (the profile rounds the bus to 3 decimals and the rate to 4 significant figures)
    assert 0 < node.cpu_adam_params_per_s <= (node.host_memory_gbps + 5e-4) * 1e9 / 28 * (1 + 5e-4)
    assert "cpu_adam_params_per_s" in node.source and "torch's fused AdamW" in node.source
    # no GEMM sweep on a CPU (issue 69): said on stderr and in source, no table, no kind
    skipped = "skipped the GEMM sweep (gemm_tflops_by_shape): no CUDA device"
    assert skipped in captured.err and skipped in node.source
    assert (node.gemm_tflops_by_shape, node.gpu_kind) == (None, None)
    assert f"written to {out}" in captured.err
    assert os.listdir(root) == []  # the measurement's files are gone


def test_without_a_usable_root_the_profile_is_refused_in_one_line(tmp_path, small, capsys):
    """Broken by removing the empty-roots checks (write_node_profile's and measure_drives'):
    statistics.StatisticsError from the median of no drive."""
    out = tmp_path / "node.yaml"
    rc = _doctor(["--dir", str(tmp_path / "missing"), "--node-profile", str(out)])
    captured = capsys.readouterr()
    assert rc == 1 and not out.exists()
    assert "ssdtrain doctor: --node-profile: no usable offload root to measure a drive in: give --dir" \
        in captured.err
