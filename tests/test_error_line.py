"""Which errors get our one ERROR line (megatron/errors.py), and that it comes once: on real
exceptions raised by the package's own code; the run inside Megatron-LM's loop is
tests/test_megatron_loop_errors.py."""

from __future__ import annotations

import errno
import logging
import os
import socket

import pytest

from ssdtrain_megatron.io.layout import Identity, LayoutError
from ssdtrain_megatron.io.roots import check_roots
from ssdtrain_megatron.megatron.errors import ours, report_error
from ssdtrain_megatron.megatron.launch import with_ssd_offload

LOGGER = "ssdtrain_megatron.megatron.errors"


def _raised(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the exception is what is tested
        return exc
    raise AssertionError("did not raise")


def _missing_root(tmp_path):
    return _raised(lambda: check_roots([str(tmp_path / "gone")], Identity(0, 0, "n", "j")))


def test_our_classes_and_errors_raised_by_our_code_are_ours_others_are_not(tmp_path):
    """Broken variant (ours() without its first check, for exits and interrupts): "assert
    LayoutError(...) is None" for the SystemExit raised while ours was handled."""
    layout = _missing_root(tmp_path)
    assert isinstance(layout, LayoutError) and ours(layout) is layout
    # An OSError from a system call our code made: its innermost frame is ours.
    from ssdtrain_megatron.io.layout import free_bytes

    oserror = _raised(lambda: free_bytes(str(tmp_path / "gone")))
    assert isinstance(oserror, FileNotFoundError) and ours(oserror) is oserror
    # Wrapped by someone else (as Megatron or autograd may): found along the chain.
    def wrap():
        try:
            raise layout
        except LayoutError as exc:
            raise RuntimeError("step failed") from exc
    wrapped = _raised(wrap)
    assert ours(wrapped) is layout
    # Not ours: raised by someone else; an exit or an interrupt, even one raised while ours was
    # being handled (argparse exits so after a type error of our flags: Megatron's parser
    # has said it already); a context said to be suppressed.
    assert ours(_raised(lambda: int("x"))) is None

    def exit_after_ours(kind):
        try:
            raise layout
        except LayoutError:
            raise kind()
    assert ours(_raised(lambda: exit_after_ours(SystemExit))) is None
    assert ours(_raised(lambda: exit_after_ours(KeyboardInterrupt))) is None

    def suppressed():
        try:
            raise layout
        except LayoutError:
            raise ValueError("bad value") from None
    assert ours(_raised(suppressed)) is None


def test_the_line_is_logged_once_at_error_level_naming_rank_and_node(tmp_path, caplog, monkeypatch):
    """Broken variant (report_error without its once-only mark): the second call logs again:
    "assert True is False"."""
    monkeypatch.setenv("RANK", "7")
    exc = _missing_root(tmp_path)
    with caplog.at_level(logging.ERROR, logger=LOGGER):
        assert report_error(exc) is True
        assert report_error(exc) is False  # an outer wrapper says nothing more
        assert report_error(_raised(lambda: int("x"))) is False
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.ERROR
    assert records[0].getMessage() == (
        f"ssdtrain: rank 7 on node {socket.gethostname()} stopped: LayoutError: offload root "
        f"{tmp_path}/gone does not exist: mount the drive or create it; we create only our job and "
        "rank folders below a root (--ssd-offload-create-dirs / create_dirs: true creates it "
        "anyway) (traceback below)")


def test_a_patched_pretrain_says_it_and_the_exception_goes_on_unchanged(caplog, monkeypatch):
    """with_ssd_offload (what patches/ add to a fork's pretrain_gpt.py), on a stand-in target:
    the error of ours leaves pretrain as it was raised, after its line."""
    import dataclasses
    import sys
    import types

    from ssdtrain_megatron.megatron import launch

    for name in ("megatron.training.arguments", "megatron.training.initialize"):
        module = types.ModuleType(name)
        module.parse_args = lambda extra_args_provider=None: None
        module.initialize_megatron = lambda *a, **k: None
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(launch.TARGETS, "stand-in", dataclasses.replace(launch.MEGATRON_LM,
                                                                          name="stand-in"))
    err = OSError(errno.EIO, os.strerror(errno.EIO))

    def pretrain():
        from ssdtrain_megatron.io.layout import free_bytes  # our frame raises it
        try:
            free_bytes("/nonexistent/for/sure")
        except FileNotFoundError as exc:
            raise err from exc

    with caplog.at_level(logging.ERROR, logger=LOGGER), pytest.raises(OSError) as raised:
        with_ssd_offload(pretrain, "stand-in")()
    assert raised.value is err
    (record,) = [r for r in caplog.records if r.name == LOGGER]
    assert "stopped: FileNotFoundError: [Errno 2] No such file or directory" in record.getMessage()
