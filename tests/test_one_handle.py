"""One installed offloader per process: megatron-core's install() and DeepSpeed's share one
slot (megatron/handle.py), so installing one while the other is installed is refused, with
the call that frees the slot, and leaves the installed one untouched."""

from __future__ import annotations

import os
import re

import pytest

pytest.importorskip("deepspeed")

from ssdtrain_megatron.config import OffloadConfig  # noqa: E402
from ssdtrain_megatron.megatron import deepspeed as ds_integration  # noqa: E402
from ssdtrain_megatron.megatron import handle  # noqa: E402
import ssdtrain_megatron.megatron as mc_integration  # noqa: E402


def _cfg(path) -> OffloadConfig:
    os.makedirs(path, exist_ok=True)
    return OffloadConfig(dirs=[str(path)], min_tensor_bytes=0)


@pytest.mark.parametrize("first, second, names", [
    (mc_integration, ds_integration, "ssdtrain_megatron.megatron.install() is active"),
    (ds_integration, mc_integration, "ssdtrain_megatron.megatron.deepspeed.install() is active"),
])
def test_installing_one_integration_while_the_other_is_installed_is_refused(tmp_path, first, second, names):
    offloader = first.install(_cfg(tmp_path / "first"))
    try:
        with pytest.raises(RuntimeError, match=rf"{re.escape(names)}.*not both.*\.uninstall\(\) before"):
            second.install(_cfg(tmp_path / "second"))
        assert first.installed().offloader is offloader  # the installed one is untouched
        assert second.installed() is None
        assert handle.installed() is first.installed()
        assert os.listdir(tmp_path / "second") == []  # refused before building an offloader
        second.uninstall()  # not installed: a no-op that does not free the other's slot
        assert first.installed().offloader is offloader
    finally:
        first.uninstall()
    assert handle.installed() is None
    offloader = second.install(_cfg(tmp_path / "second"))  # the slot is free again
    try:
        assert second.installed().offloader is offloader
    finally:
        second.uninstall()
    assert handle.installed() is None and os.listdir(tmp_path / "second") == []


def test_installing_the_same_integration_twice_says_already_called(tmp_path):
    ds_integration.install(_cfg(tmp_path))
    try:
        with pytest.raises(RuntimeError, match=r"deepspeed\.install\(\) was already called"):
            ds_integration.install(_cfg(tmp_path))
    finally:
        ds_integration.uninstall()
