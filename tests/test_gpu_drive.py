"""The drive rows know what they measured (gpucheck/gpu_drive.py): the scratch folder's
filesystem and whether it took O_DIRECT are in the results, and on tmpfs (or where O_DIRECT is
refused) the rows that time the drive are NOT RUN with the reason, instead of timing the page
cache. Real filesystems: the checkout's drive and /dev/shm (tmpfs)."""

from __future__ import annotations

import json
import os

import pytest

from ssdtrain_megatron.tools.gpucheck import gpu_check_targets, gpu_drive, gpu_perf_targets

SHM = "/dev/shm"


def _on_tmpfs(path: str) -> bool:
    return gpu_drive.filesystem(path)["type"] in gpu_drive.MEMORY_FILESYSTEMS


def test_a_drive_taking_o_direct_is_recorded_as_one(tmp_path):
    here = str(tmp_path / "scratch")
    if _on_tmpfs(str(tmp_path)):
        pytest.skip(f"{tmp_path} is on tmpfs here")
    p = gpu_drive.probe(here)
    assert p["o_direct"] is True and p["o_direct_error"] is None and p["problem"] == ""
    assert p["filesystem"] == gpu_drive.filesystem(here)["type"] not in ("unknown", "tmpfs")
    assert os.listdir(here) == []  # the probe's file is gone
    assert gpu_drive.text(p).endswith("O_DIRECT works")


@pytest.mark.skipif(not os.path.isdir(SHM) or not _on_tmpfs(SHM), reason="no tmpfs at /dev/shm")
def test_scratch_on_tmpfs_is_recorded_and_named_as_the_reason(tmp_path):
    here = os.path.join(SHM, f"gpu-drive-test-{os.getpid()}")
    try:
        p = gpu_drive.probe(here)
    finally:
        os.rmdir(here)
    assert p["filesystem"] == "tmpfs" and p["mount"] == SHM
    assert p["problem"].startswith(f"scratch {here} is on tmpfs (memory, mounted at {SHM}): the posix rows would "
                                   "time the page cache")


def test_the_filesystem_is_the_longest_mount_above_the_path(tmp_path):
    info = tmp_path / "mountinfo"
    info.write_text("22 1 252:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
                    "30 22 0:26 / /raid rw shared:9 - xfs /dev/md0 rw\n"
                    "31 22 0:27 / /ra rw shared:9 - tmpfs tmpfs rw\n")
    assert gpu_drive.filesystem("/raid/x/y", str(info)) == {"type": "xfs", "mount": "/raid", "source": "/dev/md0"}
    assert gpu_drive.filesystem("/rather", str(info))["type"] == "ext4"  # /ra is not above /rather
    assert gpu_drive.filesystem("/ra/b", str(info))["type"] == "tmpfs"


TMPFS = {"filesystem": "tmpfs", "o_direct": True, "problem": "scratch /dev/shm/s is on tmpfs (memory)"}
NO_DIRECT = {"filesystem": "fuse", "o_direct": False, "problem": "scratch /mnt/s (fuse at /mnt): O_DIRECT refused"}


@pytest.mark.parametrize("drive", [TMPFS, NO_DIRECT], ids=["tmpfs", "o_direct-refused"])
def test_every_row_that_times_the_drive_is_not_run_with_the_reason_and_the_others_are_judged(drive):
    """gpu-perf's four posix rows (io-bound's bound, stall and peak; compute-bound's) and
    gpu-check's three measure rows of posix: NOT RUN with the probe's reason; the memory
    engine's rows are judged as before. On a975649 every posix row was judged."""
    from tests.test_gpu_check import _passing_steps
    from tests.test_gpu_perf import _perf_steps

    steps = _perf_steps()
    before = {r["target"]: r["result"] for r in gpu_perf_targets.targets(steps)}
    for sub in steps["perf"]["shapes"].values():
        sub["drive"] = drive
    rows = {r["target"]: r for r in gpu_perf_targets.targets(steps)}
    posix = [t for t in rows if t.startswith(("io-bound: posix", "compute-bound: posix")) or t.endswith(": posix")]
    assert len(posix) == 4, posix
    for t, r in rows.items():
        if t in posix:
            assert (r["result"], r["detail"]) == ("NOT RUN", drive["problem"]), r
        else:
            assert r["result"] == before[t], r
    check = _passing_steps()
    check["measure"] = json.loads(json.dumps(dict(check["measure"], drive=drive)))
    rows = {r["target"]: r for r in gpu_check_targets.targets(check)}
    not_run = sorted(t for t, r in rows.items() if r["result"] == "NOT RUN")
    assert not_run == sorted(t for t in rows if "offload-posix" in t) and len(not_run) == 3, not_run
    assert all(rows[t]["detail"] == drive["problem"] for t in not_run)
