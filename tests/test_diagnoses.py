"""Diagnoses that match the measurements: the demo's "where the time went" chosen from what it
measured (tools/demo_report.py), the memory engine described as host memory, the Slurm script
run outside Slurm, and a --dir the CLI cannot use named without its internal probe file."""

from __future__ import annotations

import os
import subprocess

import pytest

from ssdtrain_megatron.tools.cli import main
from ssdtrain_megatron.tools.demo_report import StepCosts, diagnose

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--steps", "3", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2",
         "--seq-length", "64", "--micro-batch-size", "2", "--num-microbatches", "2",
         "--min-tensor-bytes", "4KiB"]


@pytest.mark.parametrize("costs, starts", [
    # blocked on IO for most of the step: the drive, whatever keep measured (even a slower keep)
    (StepCosts(keep_s=0.5, offload_s=0.4, io_wait_s=0.2, handover_s=0.0, other_cpu_s=0.0),
     "the drive: the training thread waited on IO 200 ms of each 400 ms step"),
    (StepCosts(keep_s=0.1, offload_s=0.1, io_wait_s=0.0, handover_s=0.0, other_cpu_s=0.0),
     "offload added no measurable time"),
    (StepCosts(keep_s=0.1, offload_s=0.2, io_wait_s=0.01, handover_s=0.08, other_cpu_s=0.01),
     "the hand-over: the training thread's extra CPU (offload hooks) accounts for 80 ms of the extra 100 ms"),
    (StepCosts(keep_s=0.1, offload_s=0.2, io_wait_s=0.01, handover_s=0.01, other_cpu_s=0.09),
     "CPU contention: the IO threads' system calls"),
    (StepCosts(keep_s=0.1, offload_s=0.2, io_wait_s=0.01, handover_s=0.01, other_cpu_s=0.01),
     "no single cause explains the extra 100 ms per step"),
])
def test_the_diagnosis_names_what_was_measured(costs, starts):
    assert diagnose(costs).startswith(starts), diagnose(costs)


def test_a_capped_drive_is_named_with_its_cap():
    text = diagnose(StepCosts(keep_s=0.1, offload_s=0.5, io_wait_s=0.3, handover_s=0.0, other_cpu_s=0.0),
                    bandwidth_cap_gbps=0.1)
    assert text.startswith("the drive, capped at 0.1 GB/s by bandwidth_cap_gbps: "), text


def _demo(tmp_path, capsys, *extra, shape=SMALL):
    rc = main(["demo", "--dir", str(tmp_path / "demo"), *shape, *extra])
    out = capsys.readouterr()
    assert rc == 0, out
    return out.out.splitlines()


def test_the_demo_diagnoses_a_throttled_drive_as_the_drive(tmp_path, capsys):
    """bandwidth_cap_gbps: 0.1 from a preset, and a model whose attention scores make many
    bytes for little compute (16 heads of 256x256 at hidden 64): about 38 MB per step each
    way, 0.75 s of the emulated drive's time against about 0.2 s of compute. With
    max_inflight_bytes 2 MiB forward waits for the drive (as a real slow drive makes it do);
    without it most writes are taken back at backward, the drive hides behind a slow machine's
    compute, and a loaded run read "0 ms of IO wait". Measured here: 687 ms of each 924 ms step
    blocked on IO. Broken variant (the old fixed text, "Extra time with little IO wait is CPU
    work on the IO threads."): no "diagnosis:" line, StopIteration."""
    preset = tmp_path / "cap.yaml"
    preset.write_text("offload:\n  bandwidth_cap_gbps: 0.1\n  max_inflight_bytes: 2097152\n")
    shape = list(SMALL)
    shape[shape.index("--num-attention-heads") + 1] = "16"
    shape[shape.index("--seq-length") + 1] = "256"
    lines = _demo(tmp_path, capsys, "--config", str(preset), shape=shape)
    diagnosis = next(ln for ln in lines if ln.startswith("diagnosis: "))
    assert diagnosis.startswith("diagnosis: the drive, capped at 0.1 GB/s by bandwidth_cap_gbps: "
                                "the training thread waited on IO "), diagnosis
    where = next(ln for ln in lines if ln.startswith("where the time went, per step: "))
    assert "of it at the step's end" in where


def test_the_memory_engine_is_not_called_an_ssd_and_names_no_empty_path(tmp_path, capsys):
    """Broken variant (the demo as it was): "saved to SSD: ..." and "offload files in  (page
    cache bypassed: n/a)" are printed; the first assertion fails."""
    lines = _demo(tmp_path, capsys, "--engine", "memory")
    text = "\n".join(lines)
    assert "SSD" not in text, text
    assert "offload files in  " not in text and "offload files in (" not in text
    assert any(ln.startswith("offloaded to host memory: ") for ln in lines), text
    assert any("offloaded tensors stay in host memory, no files" in ln for ln in lines), text
    header = next(ln for ln in lines if "offload to host memory (engine memory" in ln)
    assert "no offload files under " in header


def test_the_slurm_script_outside_slurm_says_to_submit_it(tmp_path):
    """Broken variant (the guard removed): "SLURM_NNODES: unbound variable", exit 1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SSDTRAIN"] = REPO
    out = subprocess.run(["bash", os.path.join(REPO, "scripts", "slurm_pretrain_gpt.sbatch")], env=env,
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "submit it with sbatch" in out.stderr and "unbound variable" not in out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize("directory, what", [("/proc/x", "cannot create it"), ("/proc", "cannot write files there")])
def test_a_dir_the_demo_cannot_use_is_named_without_the_probe_file(directory, what, capsys):
    """Broken variant (the probe's OSError described as it comes): "--dir /proc:
    /proc/.ssdtrain-probe-3giv64e6: no such file or directory". As root /proc answers ENOENT
    (said as a filesystem that takes no new files); as another user, EACCES."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux's /proc")
    rc = main(["demo", "--dir", directory])
    err = capsys.readouterr().err.strip()
    assert rc != 0 and "\n" not in err
    assert err.startswith(f"ssdtrain demo: --dir {directory}: {what}: "), err
    assert ".ssdtrain-probe" not in err
    if os.geteuid() == 0:
        assert err.endswith(": this filesystem takes no new files (/proc or /sys?); choose a directory on a drive")
