"""verify: crc32c uses the hardware CRC32C of the crc32c package, and says so when it cannot."""

import logging
import subprocess
import sys
import zlib

import crc32c
import torch

from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.io import checksum as ck
from ssdtrain_megatron.io.posix import PosixEngine


def test_the_installed_checksum_is_crc32c():
    """crc32c is in install_requires: a normal install checks chunks with CRC32C, whose value
    for the standard test vector is 0xE3069283 (zlib's CRC32 gives 0xCBF43926)."""
    assert ck.ALGORITHM == "crc32c"
    assert ck.checksum(b"123456789") == 0xE3069283
    assert zlib.crc32(b"123456789") == 0xCBF43926


def test_the_engine_stores_crc32c_of_each_chunk(tmp_path):
    """The extent's stored value is the CRC32C of the chunk's bytes (not zlib's CRC32)."""
    data = torch.randint(0, 256, (3 * 4096 + 10,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(0))
    eng = PosixEngine(OffloadConfig(dirs=[str(tmp_path)], chunk_bytes=4096, verify="crc32c"))
    try:
        eng.write(0, data).result(30)
        extents = eng._placed[0].extents
        raw = data.numpy().tobytes()
        assert [e.crc for e in extents] == [crc32c.crc32c(raw[i * 4096:(i + 1) * 4096])
                                            for i in range(len(extents))]
        out = torch.empty_like(data)
        eng.read(0, out).result(30)
        assert torch.equal(out, data)
        eng.release(0)
    finally:
        eng.close()


def test_without_the_package_zlib_is_used_and_the_warning_comes_once():
    """A --no-deps install without crc32c: zlib's CRC32, and one warning on the first use."""
    code = (
        "import sys, logging; sys.modules['crc32c'] = None\n"
        "logging.basicConfig(level=logging.WARNING, format='%(message)s')\n"
        "from ssdtrain_megatron.io import checksum as ck\n"
        "print(ck.ALGORITHM, ck.checksum(b'123456789') == 0xCBF43926, ck.checksum(b'x') >= 0)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["crc32", "True", "True"]
    lines = [ln for ln in out.stderr.splitlines() if "checksum" in ln]
    assert len(lines) == 1 and "crc32c package is not installed" in lines[0], out.stderr


def test_describe_names_the_algorithm():
    assert ck.describe().startswith("CRC32C, hardware") or ck.describe().startswith("CRC32C, software")


def test_warning_is_logged_once_in_process(caplog, monkeypatch):
    monkeypatch.setattr(ck, "ALGORITHM", "crc32")
    monkeypatch.setattr(ck, "_FUNCTION", zlib.crc32)
    ck._say_once.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="ssdtrain_megatron.io.checksum"):
            assert ck.checksum(b"123456789") == 0xCBF43926
            ck.checksum(b"abc")
        assert sum("not installed" in r.getMessage() for r in caplog.records) == 1
    finally:
        ck._say_once.cache_clear()
