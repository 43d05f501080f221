"""Zero-copy O_DIRECT: host chunks whose memory is already aligned skip the bounce buffer.

Real posix engine, real slab files under the test's directory. The counters say which way the
bytes went (``zero_copy_bytes``: in place; ``bounced_bytes``: through a worker's buffer); the
kernel's view of each slab descriptor (/proc/self/fdinfo) says they went O_DIRECT."""

from __future__ import annotations

import os

import pytest
import torch

from ssdtrain_megatron.io.layout import ALIGN
from ssdtrain_megatron.io.slab_engine import aligned_buffer
import tests.test_engines as engine_suite
from tests.bitwise import bitwise_equal
from tests.test_engines import CHUNK

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


def test_unaligned_host_memory_goes_through_the_bounce_buffer(open_engine, checksum):
    engine = open_engine("posix", verify="crc32c" if checksum else "off")
    n = 2 * CHUNK
    data, out = aligned_buffer(n + 64)[64:], aligned_buffer(n + 64)[64:]  # 64 bytes off a page
    data.copy_(_random(n, 1))
    _round_trip(engine, data, out)
    assert bitwise_equal(out, data)
    assert engine.zero_copy_bytes == 0
    assert engine.bounced_bytes == 2 * n


def test_an_unaligned_tail_is_bounced_and_the_rest_moved_in_place(open_engine, checksum):
    engine = open_engine("posix", verify="crc32c" if checksum else "off")
    n = 2 * CHUNK + 1000  # the last chunk's length is not a multiple of the alignment
    data, out = aligned_buffer(n), aligned_buffer(n)
    data.copy_(_random(n, 2))
    out.fill_(0xAA)
    _round_trip(engine, data, out)
    assert bitwise_equal(out, data)
    assert engine.zero_copy_bytes == 2 * 2 * CHUNK
    assert engine.bounced_bytes == 2 * ALIGN  # the tail, padded, once each way
