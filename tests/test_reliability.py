"""Faults injected for real: a full disk, IO errors, corruption, crashes, signals, concurrent
jobs, unsafe paths and IO that never finishes. Each fault either leaves numerics bitwise equal
(and is counted) or fails loudly, naming what failed; nothing is left on disk.

Real filesystems and processes: the full disk is a loop-mounted ext4 image (or a size-limited
tmpfs) of its own, crashes are real training subprocesses killed with real signals.
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache import IOTimeout
from ssdtrain_megatron.io import EngineError, Identity, engine_class, make_engine
from ssdtrain_megatron.io.clean import LIVE, STALE, UNKNOWN, clean_root, scan_root
from ssdtrain_megatron.io.owner import boot_id
from ssdtrain_megatron.tools.clean import add_clean_parser
from ssdtrain_megatron.io.layout import LayoutError, free_bytes, rank_dir_name
from ssdtrain_megatron.io.posix import PosixEngine
from tests.faulty import faulty_offloader
from tests.models import assert_bitwise_equal, run_steps, tiny_gpt
from tests.test_offloader import cfg, files_under, gpt_batches
from tests.drives import mount

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EIO = OSError(errno.EIO, os.strerror(errno.EIO))


def report(name: str, text: str) -> None:
    """Figures the issue asks for; shown with ``pytest -s`` (or -rP)."""
    print(f"\n[reliability] {name}: {text}")


# -- a small filesystem of its own --------------------------------------------------------------


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


@pytest.fixture
def small_fs(tmp_path):
    """A 24 MiB filesystem mounted at tmp_path/small: ext4 on a loop device (O_DIRECT works),
    else tmpfs. Skips, saying why, when neither can be mounted (not root, no loop devices)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    image = tmp_path / "small.img"
    why = []
    kind = None
    if os.geteuid() != 0:
        pytest.skip("mounting a small filesystem needs root")
    if shutil.which("mkfs.ext4"):
        with open(image, "wb") as fh:
            fh.truncate(24 << 20)
        r = _run("mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-m", "0", str(image))
        if r.returncode == 0:
            r = _run("mount", "-o", "loop", str(image), str(mnt))
            if r.returncode == 0:
                kind = "ext4"
        why.append(f"ext4 on a loop device: {r.stderr.strip() or r.returncode}")
    else:
        why.append("ext4: mkfs.ext4 not found")
    if kind is None:
        r = _run("mount", "-t", "tmpfs", "-o", "size=24m,mode=0700", "tmpfs", str(mnt))
        if r.returncode == 0:
            kind = "tmpfs"
        else:
            why.append(f"tmpfs: {r.stderr.strip() or r.returncode}")
    if kind is None:
        pytest.skip("cannot mount a small filesystem: " + "; ".join(why))
    os.chmod(mnt, 0o700)
    try:
        yield mnt, kind
    finally:
        if _run("umount", str(mnt)).returncode != 0:
            _run("umount", "-l", str(mnt))
        image.unlink(missing_ok=True)


def _fill(mnt, leave: int) -> None:
    """Take all but ``leave`` bytes of the filesystem with a file of its own."""
    free = free_bytes(str(mnt))
    fd = os.open(os.path.join(mnt, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, free - leave)
    finally:
        os.close(fd)


def test_disk_full_mid_step_falls_back_and_stays_bitwise_equal(small_fs, caplog):
    mnt, kind = small_fs
    model = tiny_gpt()
    batches = gpt_batches()
    ref = run_steps(model, batches)
    caplog.set_level(logging.WARNING, logger="ssdtrain_megatron")
    with ActivationOffloader(cfg(mnt, keep_last_layers=0)) as off:
        (rank_dir,) = off.rank_dirs
        _fill(mnt, leave=1 << 20)  # a step needs several MiB at its peak: the disk fills mid-step
        got = run_steps(model, batches, off, steps=2, wait_writes=True)  # no write cancelled before it meets the full disk
        if kind == "ext4":
            assert off.engine.page_cache_bypassed
    assert_bitwise_equal(ref, got)
    for st in got[2]:
        # Mid-step: some writes fit, the rest stayed in memory; every one counted.
        assert st.tensors_offloaded > 0 and st.fallbacks > 0, st
        assert st.bytes_on_disk == 0
    assert files_under(mnt) == [os.path.join(mnt, "filler")]
    assert not os.path.exists(rank_dir)
    # Warned once, naming the directory and the free space; the check before the next step
    # told how much is missing.
    full = [r.getMessage() for r in caplog.records if "No space left on device" in r.getMessage()]
    assert len(full) == 1 and f"MiB free in {rank_dir}" in full[0], full
    missing = [r.getMessage() for r in caplog.records if "MiB missing" in r.getMessage()]
    assert len(missing) == 1 and rank_dir in missing[0], missing
    report("disk full", f"{kind}: per step {got[2][0].tensors_offloaded} tensors written, "
           f"{got[2][0].fallbacks} kept in memory; {missing[0]}")


def test_free_space_check_says_how_much_is_missing(offload_dir):
    with ActivationOffloader(cfg(offload_dir)) as off:
        free = free_bytes(off.rank_dirs[0])
        assert off.check_free_space([free // 2]) == []
        (msg,) = off.check_free_space([free + (300 << 20)])
    assert off.rank_dirs[0] in msg and "300.0 MiB missing" in msg


@pytest.mark.parametrize("name", ["posix", pytest.param("aio", marks=pytest.mark.aio)])
def test_a_nearly_full_disk_is_not_filled_by_over_reservation(small_fs, name):
    """The slab grows in big steps; a failed grow must not keep the blocks it got (ext4 does),
    or the whole disk goes to one rank and other writers on the node fail."""
    mnt, _ = small_fs
    ok, why = engine_class(name).is_available()
    if not ok:
        pytest.skip(f"engine {name!r} cannot run here: {why}")
    eng = make_engine(OffloadConfig(dirs=[str(mnt)], engine=name))
    try:
        _fill(mnt, leave=4 << 20)
        eng.write(0, torch.zeros(1 << 20, dtype=torch.uint8)).result(30)
        assert free_bytes(str(mnt)) >= 2 << 20  # 1 MiB used, the rest still free for others
        with pytest.raises(EngineError, match=r"cannot reserve .* No space left on device \(.* MiB free in "):
            eng.write(1, torch.zeros(8 << 20, dtype=torch.uint8)).result(30)
        assert free_bytes(str(mnt)) >= 2 << 20
        eng.release(1)
        eng.release(0)
    finally:
        eng.close()


# -- IO errors through the fault hook ---------------------------------------------------------


def test_some_write_errors_fall_back_one_for_one_and_warn_once(offload_dir, caplog):
    model = tiny_gpt()
    batches = gpt_batches()
    ref = run_steps(model, batches)
    calls, failed_tensors = [], []
    lock = threading.Lock()

    def every_third_write(op, path, offset, nbytes):
        """Fails every third pwritev; a merged run's call carries several tensors, and every
        one of them (and no other) must fall back: counted from the engine's placements."""
        if op != "write":
            return None
        with lock:
            calls.append(offset)
            if len(calls) % 3:
                return None
            engine = off.engine.inner
            with engine._lock:
                placed = list(engine._placed.values())
            failed_tensors.append(sum(1 for p in placed if p.extents and
                                      offset <= p.extents[0].offset < offset + nbytes))
            return EIO

    caplog.set_level(logging.WARNING, logger="ssdtrain_megatron")
    with faulty_offloader(cfg(offload_dir)) as off:  # chunk_bytes 8 MiB: one chunk per tensor
        off.engine.fault = every_third_write
        got = run_steps(model, batches, off)
    assert_bitwise_equal(ref, got)
    assert sum(st.fallbacks for st in got[2]) == sum(failed_tensors) > 0
    assert all(st.tensors_offloaded > 0 and st.bytes_on_disk == 0 for st in got[2])
    warnings = [r for r in caplog.records if "offload write failed" in r.getMessage()]
    assert len(warnings) == 1 and "Input/output error" in warnings[0].getMessage()
    assert files_under(offload_dir) == []


def _saved_and_dropped(off, n=1, width=256):
    """Forward inside a micro-batch: (outputs whose backward reads offloaded tensors, the layer)."""
    lin = nn.Linear(width, width)
    outs = []
    with off.microbatch(0):
        for _ in range(n):
            h = lin(torch.randn(64, width))
            outs.append(h.sin())
            del h  # nothing else holds it: backward must read it back
    return outs, lin


@pytest.mark.parametrize("failing_chunk", [0, 2])
def test_read_error_in_one_chunk_raises_never_zeros(offload_dir, failing_chunk):
    """A tensor striped over two roots in four chunks; one chunk's read fails: the unpack
    raises (naming the file, offset and cause) instead of returning partly filled memory."""
    roots = [offload_dir / "a", offload_dir / "b"]
    conf = OffloadConfig(dirs=mount(*roots), min_tensor_bytes=1024, keep_last_layers=0, chunk_bytes=16384)
    with faulty_offloader(conf) as off:
        (out,), lin = _saved_and_dropped(off)  # 64 KiB: four chunks
        off.wait_writes()
        offsets = sorted({(p, o) for p in map(str, roots) for o in range(0, 32768, 16384)})
        bad_path, bad_offset = offsets[failing_chunk]

        def fault(op, path, offset, nbytes):
            if op == "read" and path.startswith(bad_path) and offset == bad_offset:
                return OSError(errno.EIO, os.strerror(errno.EIO))
            return None

        off.engine.fault = fault
        t0 = time.monotonic()
        # 16384 bytes, and a page more when the tensor's address is off a page (a shift,
        # io/bounce.py): which one depends on where the allocator put the tensor
        with pytest.raises(RuntimeError, match=rf"read of (16384|20480) bytes from {re.escape(bad_path)}/.*slab.bin at "
                                               rf"offset {bad_offset} failed: Input/output error"):
            out.sum().backward()
        assert lin.weight.grad is None and lin.bias.grad is None  # nothing computed from partial data
        assert time.monotonic() - t0 < 10
        off.end_step()
    assert files_under(offload_dir) == []


def test_a_slab_truncated_under_us_is_a_short_read_error(offload_dir):
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0)) as off:
        (out,), _ = _saved_and_dropped(off)
        off.wait_writes()
        os.truncate(os.path.join(off.rank_dirs[0], "slab.bin"), 0)
        with pytest.raises(RuntimeError, match=r"short read from .*slab.bin at offset \d+: 0 of \d+ bytes"):
            out.sum().backward()
        off.end_step()
    assert files_under(offload_dir) == []


# -- corruption ---------------------------------------------------------------------------------


def _flip(path: str, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0x5A]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


def test_checksum_catches_every_flipped_byte(tmp_path):
    """One tensor in 5 chunks over 2 roots (the last one partial); a byte flipped at the start,
    middle or end of any chunk, or several at once, is caught by every read."""
    chunk = 16384
    roots = mount(tmp_path / "r0", tmp_path / "r1")
    eng = PosixEngine(OffloadConfig(dirs=roots, chunk_bytes=chunk, verify="crc32c", io_timeout_s=30))
    try:
        data = torch.randint(0, 256, (4 * chunk + 1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        eng.write(0, data).result(30)
        # (root, offset in its slab) of every data byte worth hitting: chunk i is on root i % 2,
        # its bytes ``shift`` into its place (io/bounce.py).
        extents = eng._placed[0].extents
        assert [e.length for e in extents] == [chunk] * 4 + [1000] and [e.root for e in extents] == [0, 1, 0, 1, 0]
        targets = []
        for e in extents:
            at = e.offset + e.shift
            targets += [(e.root, at), (e.root, at + e.length // 2), (e.root, at + e.length - 1)]
        slabs = [os.path.join(d, "slab.bin") for d in eng.rank_dirs]
        caught = 0
        for root, offset in targets:
            _flip(slabs[root], offset)
            with pytest.raises(EngineError, match=rf"checksum mismatch reading \d+ bytes from {re.escape(slabs[root])} "
                                                  rf"at offset \d+"):
                eng.read(0, torch.empty_like(data)).result(30)
            caught += 1
            _flip(slabs[root], offset)  # restore: the next read is clean again
            out = torch.empty_like(data)
            eng.read(0, out).result(30)
            assert torch.equal(out, data)
        for root, offset in targets[::4]:
            _flip(slabs[root], offset)
        with pytest.raises(EngineError, match="checksum mismatch"):
            eng.read(0, torch.empty_like(data)).result(30)
        caught += 1
        assert caught == len(targets) + 1
        report("checksum detection", f"{caught}/{len(targets) + 1} corruptions caught")
        eng.release(0)
    finally:
        eng.close()


def test_checksum_cost_is_measured(offload_dir):
    """The checksum's cost per MB (what every checksummed chunk pays twice: at write and at
    read; CRC32C in hardware, io/checksum.py), and the end-to-end write+read time of 32 MiB with
    and without checksums."""
    import mmap

    from ssdtrain_megatron.io.checksum import ALGORITHM
    from ssdtrain_megatron.io.checksum import checksum as crc

    buf = mmap.mmap(-1, 8 << 20)
    buf.write(os.urandom(8 << 20))
    reps = 8
    t0 = time.perf_counter()
    for _ in range(reps):
        crc(buf)
    crc_us_per_mb = (time.perf_counter() - t0) / (reps * 8 * 1.048576) * 1e6
    buf.close()
    data = torch.randint(0, 256, (32 << 20,), dtype=torch.uint8)
    timings = {}
    for checksum in (False, True, False, True):
        eng = PosixEngine(OffloadConfig(dirs=[str(offload_dir)], verify="crc32c" if checksum else "off"))
        try:
            t0 = time.perf_counter()
            eng.write(0, data).result(60)
            out = torch.empty_like(data)
            eng.read(0, out).result(60)
            dt = time.perf_counter() - t0
            assert torch.equal(out, data)
            eng.release(0)
        finally:
            eng.close()
        timings[checksum] = min(timings.get(checksum, dt), dt)
    mb = 32 * 1.048576
    extra = (timings[True] - timings[False]) / mb * 1e6
    report("checksum cost", f"{ALGORITHM} {crc_us_per_mb:.0f} us/MB per pass ({1e3 / crc_us_per_mb:.2f} GB/s); "
           f"write+read of 32 MiB: {timings[False] / mb * 1e6:.0f} us/MB without, "
           f"{timings[True] / mb * 1e6:.0f} us/MB with checksums ({extra:+.0f} us/MB)")


# -- IO that never finishes -------------------------------------------------------------------


class Gate:
    """A fault that blocks the IO worker until opened: IO that hangs (a dead drive)."""

    def __init__(self, op: str) -> None:
        self.op = op
        self.event = threading.Event()
        self.blocked = 0

    def __call__(self, op, path, offset, nbytes):
        if op == self.op:
            self.blocked += 1
            self.event.wait(60)
        return None


def test_a_read_that_never_finishes_raises_iotimeout_naming_the_tensor(offload_dir):
    with faulty_offloader(cfg(offload_dir, keep_last_layers=0, io_timeout_s=0.3)) as off:
        (out,), _ = _saved_and_dropped(off)
        off.wait_writes()
        gate = off.engine.fault = Gate("read")
        t0 = time.monotonic()
        with pytest.raises(IOTimeout, match=r"waited 0.3s for the reading of a tensor of shape \[64, 256\] "
                                            r"and dtype torch.float32"):
            out.sum().backward()
        assert time.monotonic() - t0 < 5
        gate.event.set()  # the drive comes back: the step finishes and cleans up
        off.end_step()
    assert files_under(offload_dir) == []


def test_back_pressure_on_writes_that_never_finish_raises_iotimeout(offload_dir):
    with faulty_offloader(cfg(offload_dir, keep_last_layers=0, io_timeout_s=0.3,
                              max_inflight_bytes=64 * 1024)) as off:
        gate = off.engine.fault = Gate("write")
        with pytest.raises(IOTimeout, match=r"waited 0.3s for 65536 bytes of writes to finish before writing "
                                            r"a tensor of shape \[64, 256\]"):
            _saved_and_dropped(off, n=2)
        with pytest.raises(IOTimeout, match=r"waited 0.3s for 65536 bytes of pending writes"):
            off.end_step()
        gate.event.set()
        off.end_step()
    assert files_under(offload_dir) == []


def test_space_is_freed_when_a_tensor_is_released_during_its_write(offload_dir, caplog):
    """Backward is done with a tensor while its write is still in flight (it was forwarded from
    memory): its extent is freed as soon as the write completes, not at the end of the step."""
    caplog.set_level(logging.WARNING, logger="ssdtrain_megatron")
    with faulty_offloader(cfg(offload_dir, keep_last_layers=0)) as off:
        gate = off.engine.fault = Gate("write")
        (out,), _ = _saved_and_dropped(off)
        # Both writes have started (an IO thread places a tensor as it takes it, then blocks
        # at the gate) before backward runs: one not yet started would be cancelled instead.
        deadline = time.monotonic() + 10
        while off.engine.bytes_on_disk < 2 * (65536 + 4096) and time.monotonic() < deadline:
            time.sleep(0.01)
        placed = off.engine.bytes_on_disk  # 64 KiB each and a page of room for a shift (io/bounce.py)
        assert placed == 2 * (65536 + 4096)
        out.sum().backward()
        del out  # every handle is gone; both writes are still blocked
        assert off.engine.bytes_on_disk == placed
        gate.event.set()
        off.wait_writes()
        assert off.engine.bytes_on_disk == 0
        st = off.end_step()
    assert st.tensors_forwarded == 2 and st.bytes_on_disk == 0
    assert not any("still held by autograd" in r.getMessage() for r in caplog.records)


def test_close_with_io_hung_forever_returns_and_removes_the_files(offload_dir, caplog):
    off = faulty_offloader(cfg(offload_dir, keep_last_layers=0, io_timeout_s=0.3))
    gate = off.engine.fault = Gate("write")
    try:
        outs = _saved_and_dropped(off)
        t0 = time.monotonic()
        off.close()  # the write never completes: close must not wait for it forever
        assert time.monotonic() - t0 < 5
        assert gate.blocked >= 1
        assert files_under(offload_dir) == []
        assert any("still running" in r.getMessage() for r in caplog.records)
    finally:
        gate.event.set()
    del outs


# -- crashes, signals and concurrent jobs: real subprocesses ----------------------------------

CHILD = r"""
import json, os, sys, time
import torch
from torch import nn
from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from tests.bitwise import bitwise_equal

mode, job, roots = sys.argv[1], sys.argv[2], sys.argv[3:]
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(4)])
batches = [torch.randn(32, 256, generator=torch.Generator().manual_seed(i)) for i in range(2)]

def step(off):
    model.zero_grad(set_to_none=True)
    for mb, x in enumerate(batches):
        if off is None:
            loss = model(x).pow(2).mean()
        else:
            with off.microbatch(mb):
                loss = model(x).pow(2).mean()
            off.wait_writes()  # on disk before backward: it reads them back
        loss.backward()
    if off is not None:
        off.end_step()
    return [p.grad.clone() for p in model.parameters()]

cfg = OffloadConfig(dirs=roots, job=job, min_tensor_bytes=1024, keep_last_layers=0)
with ActivationOffloader(cfg) as off:
    if mode == "hold":  # stop in the middle of a step, with activations on disk
        with off.microbatch(0):
            loss = model(batches[0]).pow(2).mean()
        off.wait_writes()
        print(json.dumps({"dirs": off.rank_dirs, "pid": os.getpid()}), flush=True)
        time.sleep(120)
        loss.backward()
        off.end_step()
    else:  # "train": wait until told, then train next to the other job and compare
        print(json.dumps({"dirs": off.rank_dirs, "pid": os.getpid()}), flush=True)
        sys.stdin.readline()
        problems, steps = [], 0
        for _ in range(3):
            ref = step(None)
            got = step(off)
            st = off.last_step_stats
            if not (len(ref) == len(got) > 0 and all(bitwise_equal(a, b) for a, b in zip(ref, got))):
                problems.append(f"step {steps}: gradients differ bitwise")
            if not (st.fallbacks == 0 and st.tensors_offloaded > 0 and st.bytes_on_disk == 0 and st.bytes_read > 0):
                problems.append(f"step {steps}: {st}")
            steps += 1
        print(json.dumps({"ok": not problems, "problems": problems, "steps": steps,
                          "dirs_present": [os.path.isdir(d) for d in off.rank_dirs]}), flush=True)
"""


class Child:
    """A training subprocess (CHILD) on the given roots; ``ready`` is its first JSON line."""

    def __init__(self, mode: str, job: str, roots) -> None:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, mode, job, *map(str, roots)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env=env, cwd=ROOT)
        self.ready = None

    def wait_ready(self, timeout: float = 120) -> dict:
        line = _readline(self.proc, timeout)
        if not line:
            self.proc.kill()
            raise AssertionError(f"child failed to start: {self.proc.stderr.read()}")
        self.ready = json.loads(line)
        return self.ready

    def kill(self, sig: int) -> int:
        os.kill(self.proc.pid, sig)
        return self.proc.wait(60)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(60)
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    out = []
    t = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out else ""


@pytest.fixture
def children():
    started = []

    def start(mode, job, roots):
        mount(*roots)  # the drives
        c = Child(mode, job, roots)
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def _clean_cli(argv):
    parser = argparse.ArgumentParser(prog="ssdtrain")
    add_clean_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["clean", *argv])
    return args.func(args)


def test_sigkill_leaves_files_that_restart_and_clean_remove_but_a_live_job_keeps(tmp_path, children, capsys):
    root1, root2 = tmp_path / "nvme0", tmp_path / "nvme1"
    victim1 = children("hold", "crash1", [root1])
    victim2 = children("hold", "crash2", [root2])
    live = children("hold", "live", [root1, root2])
    for c in (victim1, victim2, live):
        c.wait_ready()
    live_files = [f for f in files_under(tmp_path) if ".live." in f]
    assert len(live_files) == 4  # owner.json and slab.bin in each of its two directories
    for c in (victim1, victim2):
        assert c.kill(signal.SIGKILL) == -signal.SIGKILL
    # SIGKILL: nothing ran, the files are still there (owner.json and the slab with data).
    for c in (victim1, victim2):
        (d,) = c.ready["dirs"]
        assert sorted(os.listdir(d)) == ["owner.json", "slab.bin"]
        assert os.path.getsize(os.path.join(d, "slab.bin")) > 0
    # A dry run reports both and removes nothing.
    capsys.readouterr()
    assert _clean_cli(["--dry-run", str(root1), str(root2)]) == 0
    out = capsys.readouterr().out
    assert out.count("would remove") == 2 and "pid" in out and out.count("live ") == 2
    assert all(os.path.isdir(c.ready["dirs"][0]) for c in (victim1, victim2))
    # The next start on root1 removes victim1's leftovers, and only those.
    with ActivationOffloader(cfg(root1)) as off:
        assert not os.path.exists(victim1.ready["dirs"][0])
        assert os.path.isdir(victim2.ready["dirs"][0])
        # `ssdtrain clean` removes victim2's; our own live directory and the live job's stay.
        assert _clean_cli([str(root1), str(root2)]) == 0
        out = capsys.readouterr().out
        assert out.count("removed") == 1 and victim2.ready["dirs"][0] in out
        assert not os.path.exists(victim2.ready["dirs"][0])
        assert os.path.isdir(off.rank_dirs[0])
    assert [f for f in files_under(tmp_path) if ".live." in f] == live_files
    assert live.proc.poll() is None
    assert sorted(os.listdir(tmp_path / "nvme0")) == [os.path.basename(live.ready["dirs"][0])]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_clean_up_at_once(tmp_path, children, sig):
    child = children("hold", "sig", [tmp_path / "a", tmp_path / "b"])
    dirs = child.wait_ready()["dirs"]
    assert all("slab.bin" in os.listdir(d) for d in dirs)
    t0 = time.monotonic()
    rc = child.kill(sig)
    assert time.monotonic() - t0 < 20
    assert rc != 0  # it died of the signal (SIGINT: via KeyboardInterrupt)
    assert files_under(tmp_path) == []
    assert os.listdir(tmp_path / "a") == [] and os.listdir(tmp_path / "b") == []


def test_two_jobs_on_the_same_roots_do_not_collide(tmp_path, children):
    roots = [tmp_path / "nvme0", tmp_path / "nvme1"]
    jobs = [children("train", "same", roots) for _ in range(2)]
    ready = [j.wait_ready() for j in jobs]
    # Both are open at once, each in its own directories, each sees the other's as live.
    assert len({d for r in ready for d in r["dirs"]}) == 4
    assert all(item.verdict == LIVE for root in roots for item in scan_root(str(root)))
    for j in jobs:
        j.proc.stdin.write("go\n")
        j.proc.stdin.flush()
    results = [json.loads(_readline(j.proc, 180) or "{}") for j in jobs]
    assert [r.get("ok") for r in results] == [True, True], ([r.get("problems") for r in results],
                                                           [j.proc.stderr.read() for j in jobs])
    assert all(r["dirs_present"] == [True, True] for r in results)
    assert [j.proc.wait(60) for j in jobs] == [0, 0]
    assert files_under(tmp_path) == []


# -- what the sweep never touches ------------------------------------------------------------


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _fake_rank_dir(root, pid, host=None, job="old", owner=True, extra=None):
    """The directory a job of this version left: its record names this kernel's boot id (another
    machine's for another ``host``) and a lock its writer no longer holds."""
    boot = boot_id() if host is None else "another machine's boot id"
    host = host or Identity.detect("x").hostname
    d = os.path.join(root, rank_dir_name(job, host, 0, pid))
    os.makedirs(d, mode=0o700)
    if owner:
        with open(os.path.join(d, "owner.json"), "w") as fh:
            json.dump({"pid": pid, "hostname": host, "job": job, "rank": 0, "boot_id": boot, "lock": "flock"}, fh)
    with open(os.path.join(d, "slab.bin"), "wb") as fh:
        fh.write(b"x" * 8192)
    if extra:
        extra(d)
    return d


def _lock(rank_dir) -> int:
    """Hold ``rank_dir``'s owner.json locked, as its running job does (close the fd to let go)."""
    fd = os.open(os.path.join(rank_dir, "owner.json"), os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def test_the_sweep_removes_only_dead_jobs_own_directories(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("keep me")
    dead = _dead_pid()
    stale = _fake_rank_dir(root, dead)
    held = []  # the live job's lock on its owner.json
    keep = {
        "live": _fake_rank_dir(root, os.getpid(), job="live", extra=lambda d: held.append(_lock(d))),
        "other host": _fake_rank_dir(root, dead, host="some-other-node", job="remote"),
        "no owner": _fake_rank_dir(root, dead, job="noowner", owner=False),
        "subdirectory": _fake_rank_dir(root, dead, job="subdir", extra=lambda d: os.mkdir(os.path.join(d, "sub"))),
        "symlink inside": _fake_rank_dir(root, dead, job="link",
                                         extra=lambda d: os.symlink(outside / "precious", os.path.join(d, "x"))),
    }
    link = os.path.join(root, rank_dir_name("symlinked", Identity.detect("x").hostname, 0, dead))
    os.symlink(outside, link)
    (root / "not-ours.txt").write_text("x")
    found = {os.path.basename(i.path): i for i in clean_root(str(root))}
    assert found[os.path.basename(stale)].verdict == STALE and found[os.path.basename(stale)].removed
    assert not os.path.exists(stale)
    assert found[os.path.basename(keep["live"])].verdict == LIVE
    for why in ("other host", "no owner", "symlinked"):
        name = os.path.basename(keep.get(why, link))
        assert found[name].verdict == UNKNOWN, (why, found[name])
    for why in ("subdirectory", "symlink inside"):  # dead, but holding something we did not create
        item = found[os.path.basename(keep[why])]
        assert item.verdict == STALE and not item.removed and "not a plain file" in item.error
    assert all(os.path.isdir(d) for d in keep.values())
    assert os.path.islink(link) and (root / "not-ours.txt").exists()
    assert (outside / "precious").read_text() == "keep me" and sorted(os.listdir(outside)) == ["precious"]
    os.close(held[0])


def test_a_reused_pid_does_not_keep_a_dead_jobs_directory(tmp_path):
    """owner.json records when its process started; another process that now has the pid
    (here: this one) does not make the directory live. (A record without a lock, as an older
    version wrote it: judged by its pid on this kernel.)"""
    d = _fake_rank_dir(tmp_path, os.getpid())
    with open(os.path.join(d, "owner.json"), "w") as fh:
        json.dump({"pid": os.getpid(), "hostname": Identity.detect("x").hostname, "job": "old", "rank": 0,
                   "start_ticks": 1, "boot_id": boot_id()}, fh)  # no lock: judged by its pid
    (item,) = clean_root(str(tmp_path), dry_run=True)
    assert item.verdict == STALE and "reused" in item.reason


def test_clean_of_a_missing_root_fails_with_its_name(tmp_path, capsys):
    assert _clean_cli([str(tmp_path / "nope")]) == 1
    assert f"{tmp_path / 'nope'}: No such file or directory" in capsys.readouterr().err


# -- path safety ------------------------------------------------------------------------------


def test_symlink_where_the_job_directory_should_be_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir()
    (tmp_path / "ssd").mkdir()
    os.symlink(target, tmp_path / "ssd" / "j1")
    with pytest.raises(LayoutError, match=r"ssd/j1' \(from the template .*\{job\}'\) is a symlink where a job "
                                          r"directory should be"):
        ActivationOffloader(OffloadConfig(dirs=[str(tmp_path / "ssd" / "{job}")], job="j1"))
    assert os.listdir(target) == []


def test_world_writable_job_directory_without_sticky_bit_is_refused(tmp_path):
    (tmp_path / "ssd" / "j1" / "r0").mkdir(parents=True)
    os.chmod(tmp_path / "ssd" / "j1", 0o777)
    with pytest.raises(LayoutError, match="world-writable without the sticky bit"):
        ActivationOffloader(OffloadConfig(dirs=[str(tmp_path / "ssd" / "{job}" / "r{rank}")], job="j1"))
    assert os.listdir(tmp_path / "ssd" / "j1" / "r0") == []


@pytest.mark.parametrize("field,value", [("hostname", "evil/../../etc"), ("hostname", ".."), ("job", "")])
def test_placeholder_values_that_would_escape_the_template_are_refused(tmp_path, field, value):
    ident = dict(rank=0, local_rank=0, hostname="node", job="j")
    ident[field] = value
    with pytest.raises(LayoutError, match=rf"\{{{field}\}}=.* cannot be used in the offload path"):
        PosixEngine(OffloadConfig(dirs=[str(tmp_path / "ssd" / "{hostname}" / "{job}")]), Identity(**ident))
    assert not (tmp_path / "ssd").exists()
