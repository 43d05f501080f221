"""What comes back is what went out (issue 28, section 3): one byte of a slab file flipped
between a tensor's write and its read. With ``--ssd-offload-verify crc32c`` (or its deprecated
spelling ``--ssd-offload-checksum``), backward fails with one error naming the tensor's layer
and the file (never a wrong tensor); without, the wrong bytes reach backward, which is what
docs/design.md says can happen (a real file, a real flip, the posix engine). The config is built from
the flags, as a Megatron job builds it."""

from __future__ import annotations

import argparse
import os
import re

import pytest
import torch
from torch import nn

from ssdtrain_megatron import ActivationOffloader
from ssdtrain_megatron.megatron.args import add_ssd_offload_args, config_from_args
from tests.test_offloader import files_under

DESIGN_DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                          "design.md")


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x5A]))


def _config(offload_dir, flags):
    parser = add_ssd_offload_args(argparse.ArgumentParser())
    args = parser.parse_args(["--ssd-offload", "--ssd-offload-dir", str(offload_dir),
                              "--ssd-offload-min-tensor-bytes", "1KiB",
                              "--ssd-offload-keep-last-layers", "0", *flags])
    return config_from_args(args)


def _run(offload_dir, flags):
    torch.manual_seed(0)
    lin = nn.Linear(128, 128)
    x = torch.randn(128, 128, requires_grad=True)
    conf = _config(offload_dir, flags)
    checksum = conf.verify != "off"
    with ActivationOffloader(conf) as off:
        with off.microbatch(0):
            with off.layer(5):
                out = lin(x).sin()  # lin's output (64 KiB) is saved by sin and dropped here
        off.wait_writes()
        slab = os.path.join(off.rank_dirs[0], "slab.bin")
        for offset in range(0, os.path.getsize(slab), 4096):
            _flip(slab, offset + 100)  # one byte in every page: whichever holds the tensor
        try:
            out.sum().backward()
            return None, lin, slab, off.end_step()
        except RuntimeError as exc:
            off.end_step()
            return exc, lin, slab, None
        finally:
            assert x.grad is None or checksum is False


@pytest.mark.parametrize("flags", [["--ssd-offload-verify", "crc32c"], ["--ssd-offload-checksum"]],
                         ids=["verify", "deprecated-checksum-flag"])
def test_with_verify_a_flipped_byte_is_a_loud_error_naming_layer_and_file(offload_dir, flags):
    """Break: the flag's action storing 'off' (or slab_engine's ``self._checksum = False``) ->
    'a flipped byte reached backward without an error'."""
    exc, lin, slab, _ = _run(offload_dir, flags)
    assert exc is not None, "a flipped byte reached backward without an error"
    msg = str(exc)
    assert re.search(r"\(layer 5, micro-batch 0\) failed \(3 attempts\), the only copy is lost: "
                     r"checksum mismatch reading \d+ bytes from " + re.escape(slab), msg), msg
    assert lin.weight.grad is None  # nothing computed from the corrupted tensor
    assert files_under(offload_dir) == []


@pytest.mark.parametrize("flags", [[], ["--ssd-offload-verify", "off"]], ids=["default", "off"])
def test_without_verify_the_flipped_byte_reaches_backward_as_the_readme_says(offload_dir, flags):
    exc, lin, _, st = _run(offload_dir, flags)
    assert exc is None and st.bytes_read > 0  # read back from the (corrupted) file
    torch.manual_seed(0)
    ref = nn.Linear(128, 128)
    x = torch.randn(128, 128, requires_grad=True)
    ref(x).sin().sum().backward()
    assert not torch.equal(lin.weight.grad.view(torch.int32), ref.weight.grad.view(torch.int32))
    text = open(DESIGN_DOC, encoding="utf-8").read()
    assert "Without verification, a byte changed on the drive" in text
