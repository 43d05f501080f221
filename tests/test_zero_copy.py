"""Zero-copy O_DIRECT: host chunks whose memory is already aligned skip the bounce buffer.

Real posix engine, real slab files under the test's directory. The counters say which way the
bytes went (``zero_copy_bytes``: in place; ``bounced_bytes``: through a worker's buffer); the
kernel's view of each slab descriptor (/proc/self/fdinfo) says they went O_DIRECT."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from ssdtrain_megatron.io.layout import ALIGN
from ssdtrain_megatron.io.slab_engine import aligned_buffer
import tests.test_engines as engine_suite
from tests.bitwise import bitwise_equal
from tests.test_engines import CHUNK
from tests.faulty import FaultyEngine

open_engine = engine_suite.open_engine  # the engine suite's fixture

pytestmark = pytest.mark.parametrize("checksum", [False, True], ids=["plain", "checksum"])


def _random(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def _o_direct(fd: int) -> bool:
    """What the kernel says of the descriptor (/proc/self/fdinfo), not what the engine counts."""
    with open(f"/proc/self/fdinfo/{fd}") as fh:
        flags = next(int(line.split()[1], 8) for line in fh if line.startswith("flags:"))
    return bool(flags & os.O_DIRECT)


def _round_trip(engine, data: torch.Tensor, out: torch.Tensor) -> None:
    """Write and read back; in between, every open slab file must be an O_DIRECT descriptor.
    Broken variant: slab.py opening without O_DIRECT (``flags = os.O_RDWR``): the counters
    still say zero-copy, and this fails with "not opened O_DIRECT"."""
    probe = os.path.join(str(engine.test_roots[0]), "o_direct_probe")
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600))
    except OSError as exc:
        pytest.skip(f"the filesystem under the test's directory refuses O_DIRECT: {exc}")
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    assert engine.write(7, data).result(30) == data.numel()
    fds = [s.fd for s in engine._slabs if s.fd is not None]
    assert fds, "no slab file is open after a write"
    assert all(_o_direct(fd) for fd in fds), "a slab file was not opened O_DIRECT: the IO went through the page cache"
    assert engine.read(7, out).result(30) == out.numel()
    engine.release(7)


def test_aligned_host_memory_is_written_and_read_in_place(open_engine, checksum):
    engine = open_engine("posix", verify="crc32c" if checksum else "off")
    n = 3 * CHUNK + 2 * ALIGN  # several chunks, every one a multiple of the alignment
    data, out = aligned_buffer(n), aligned_buffer(n)
    data.copy_(_random(n))
    _round_trip(engine, data, out)
    assert bitwise_equal(out, data)
    assert engine.zero_copy_bytes == 2 * n  # written from `data`, read into `out`
    assert engine.bounced_bytes == 0  # the bounce buffer was never used


def _in_place(engine, shift: int, n: int) -> int:
    """Bytes of an ``n``-byte chunk stored at ``shift`` that the IO moves in place (bounce.py)."""
    g = engine.staging.dio_align
    head = -(-shift // g) * g
    return max(0, (shift + n) // g * g - head)


def _slab_bytes(engine, key: int) -> bytes:
    """What the first extent of ``key`` holds on disk (its whole padded place)."""
    ext = engine._placed[key].extents[0]
    size = next(size for root, off, size in engine._placed[key].allocs if off == ext.offset and root == ext.root)
    slab = next(engine.test_roots[ext.root].rglob("slab.bin"))
    with open(slab, "rb") as fh:
        fh.seek(ext.offset)
        return fh.read(size)


def test_host_memory_off_a_page_is_written_through_the_bounce_buffer_and_read_in_place(open_engine, checksum):
    """A CPU tensor starts 64 bytes past a page (glibc). Its chunks are copied whole into the
    bounce buffer, stored at that shift (bounce.py: the drive takes fresh activations' pages
    slower in place than the bounce buffer's), so the read back into memory at the same residue
    moves all of it but a head and a tail below the direct-IO granularity in place. Broken
    variants: shift 0 for every write (``ChunkStaging.shift_for`` returning 0): nothing moves
    in place, and this fails; writes in place whatever the alignment (``fill`` without its
    page test): zero_copy_bytes counts both ways, and this fails."""
    engine = open_engine("posix", verify="crc32c" if checksum else "off")
    n = 2 * CHUNK
    data, out = aligned_buffer(n + 64)[64:], aligned_buffer(n + 64)[64:]  # 64 bytes off a page
    data.copy_(_random(n, 1))
    _round_trip(engine, data, out)
    assert bitwise_equal(out, data)
    assert engine.staging.dio_align in (512, ALIGN)
    moved = 2 * _in_place(engine, 64, CHUNK)  # two chunks, the read only
    assert moved > 0 and engine.zero_copy_bytes == moved
    assert engine.zero_copy_bytes + engine.bounced_bytes == 2 * 2 * (CHUNK + ALIGN)  # a page more each


def test_nothing_around_the_tensor_reaches_the_disk_or_is_overwritten_by_a_read(open_engine, checksum):
    """The bytes before and after a tensor in its memory (another allocation's) are neither
    written to the file (the extent holds zeros around the tensor's bytes) nor touched by the
    read into a target with guard bytes around it. Broken variant: the body's memoryview in
    ``_in_place`` starting ``ext.shift`` bytes early (``addr - ext.shift``): the read writes
    the guard, and this fails."""
    engine = open_engine("posix", verify="crc32c" if checksum else "off")
    n = CHUNK - 1000
    src, dst = aligned_buffer(n + 2 * ALIGN), aligned_buffer(n + 2 * ALIGN)
    src.fill_(0x55)
    dst.fill_(0xAA)
    data, out = src[100:100 + n], dst[100:100 + n]
    data.copy_(_random(n, 3))
    assert engine.write(5, data).result(30) == n
    on_disk = torch.frombuffer(bytearray(_slab_bytes(engine, 5)), dtype=torch.uint8)
    ext = engine._placed[5].extents[0]
    assert ext.shift == 100 % engine.staging.dio_align
    assert bitwise_equal(on_disk[ext.shift:ext.shift + n], data)
    assert int(on_disk[:ext.shift].count_nonzero()) == 0 and int(on_disk[ext.shift + n:].count_nonzero()) == 0
    assert engine.read(5, out).result(30) == n
    assert bitwise_equal(out, data)
    assert bool((dst[:100] == 0xAA).all()) and bool((dst[100 + n:] == 0xAA).all())
    assert engine.zero_copy_bytes == _in_place(engine, ext.shift, n) > 0  # the read (off a page)


def test_a_read_into_memory_at_another_residue_goes_through_the_bounce_buffer(open_engine, checksum):
    """Written from memory 64 bytes off a page, read into memory 128 bytes off one: the file
    position and the target's address do not agree, so the read is bounced, and right (the
    write, off a page, is bounced too)."""
    engine = open_engine("posix", verify="crc32c" if checksum else "off")
    n = CHUNK
    data, out = aligned_buffer(n + ALIGN)[64:64 + n], aligned_buffer(n + ALIGN)[128:128 + n]
    data.copy_(_random(n, 4))
    _round_trip(engine, data, out)
    assert bitwise_equal(out, data)
    assert engine.zero_copy_bytes == 0 and engine.bounced_bytes == 2 * (n + ALIGN)


def test_a_tensor_dropped_by_its_owner_stays_alive_until_its_write_completed(open_engine, checksum):
    """The engine holds the tensor it writes in place until the write is done: the caller may
    drop its reference at once (the offloader does, once the model frees the activation).
    Broken variant: ``Request.address()`` dropping ``self.tensor`` once it read the address:
    the memory is freed and refilled while queued, and the bytes read back differ."""
    engine = open_engine("posix", verify="crc32c" if checksum else "off", io_threads=1)
    gate = threading.Event()
    engine = FaultyEngine(engine, lambda op, path, offset, nbytes: gate.wait(30) and None)
    n = 4 * CHUNK
    data = torch.empty(n, dtype=torch.uint8)
    data.copy_(_random(n, 5))
    expected = data.clone()
    fut = engine.write(9, data)
    del data
    filler = [torch.full((n,), 0x77, dtype=torch.uint8) for _ in range(8)]  # reuse freed memory
    gate.set()
    assert fut.result(30) == n
    out = torch.empty(n, dtype=torch.uint8)
    assert engine.read(9, out).result(30) == n
    assert bitwise_equal(out, expected)
    del filler


def test_an_unaligned_tail_is_bounced_and_the_rest_moved_in_place(open_engine, checksum):
    engine = open_engine("posix", verify="crc32c" if checksum else "off")
    n = 2 * CHUNK + 1000  # the last chunk's length is not a multiple of the alignment
    data, out = aligned_buffer(n), aligned_buffer(n)
    data.copy_(_random(n, 2))
    out.fill_(0xAA)
    _round_trip(engine, data, out)
    assert bitwise_equal(out, data)
    tail_in_place = _in_place(engine, 0, 1000)  # 512 of the 1000 bytes where the granularity is 512
    assert engine.zero_copy_bytes == 2 * (2 * CHUNK + tail_in_place)
    assert engine.bounced_bytes == 2 * (ALIGN - tail_in_place)  # the rest of the tail's page, each way


def test_a_drive_that_refuses_sub_page_pieces_gets_page_granularity(open_engine, checksum, monkeypatch):
    """The probe: a system call refusing the 512-byte piece (EINVAL, as a 4Kn drive does)
    gives page granularity, and chunks off a page are then read in place for all but a
    page-sized head and tail (written through the bounce buffer). Broken variant:
    ``probe_dio_align`` returning DIO_PROBE whatever the IO said: the first assertion fails."""
    import errno

    from ssdtrain_megatron.io import bounce

    engine = open_engine("posix", verify="crc32c" if checksum else "off")
    directory = engine.rank_dirs[0]

    def refuse(fd, buffers, offset):
        raise OSError(errno.EINVAL, "Invalid argument")

    with monkeypatch.context() as m:
        m.setattr(bounce.os, "pwritev", refuse)
        assert bounce.probe_dio_align(directory) == ALIGN
    assert not [f for f in os.listdir(directory) if f.startswith("dio-probe")]
    engine.staging.move_in_place(ALIGN)  # before any write: what the probe said on such a drive
    n = 2 * CHUNK
    data, out = aligned_buffer(n + 64)[64:], aligned_buffer(n + 64)[64:]
    data.copy_(_random(n, 6))
    _round_trip(engine, data, out)
    assert bitwise_equal(out, data)
    assert engine.zero_copy_bytes == 2 * (CHUNK - ALIGN)  # [4096, CHUNK) of each chunk, read back
