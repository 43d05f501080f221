"""Safe roots (io/roots.py): a missing offload root is refused, not created on the system disk;
create_dirs opts in; where each root lies is logged, with warnings for a root on the
filesystem of / and for two roots on one drive; `ssdtrain doctor` says the same."""

from __future__ import annotations

import json
import logging
import os

import pytest

from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.io.layout import Identity, LayoutError
from ssdtrain_megatron.io.posix import PosixEngine
from ssdtrain_megatron.io.roots import check_roots, root_of
from ssdtrain_megatron.tools.cli import main

IDENT = Identity(rank=0, local_rank=0, hostname="node-a", job="77")
REFUSAL = ("does not exist: mount the drive or create it; we create only our job and rank "
           "folders below a root")


def _engine(tmp_path, dirs, **kw):
    return PosixEngine(OffloadConfig(dirs=[str(d) for d in dirs], job="77", **kw), ident=IDENT)


def test_a_missing_root_is_refused_in_one_line_naming_it_and_nothing_is_created(tmp_path):
    """Broken variant (check_roots call removed from SlabEngine._open_slabs): the engine starts,
    creates tmp/nvme0/ssdtrain/77 and pytest says "DID NOT RAISE LayoutError"."""
    template = f"{tmp_path}/nvme{{local_rank}}/ssdtrain/{{job}}"
    with pytest.raises(LayoutError) as err:
        _engine(tmp_path, [template])
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith(f"offload root {tmp_path}/nvme0/ssdtrain (dirs[0] {template!r}) {REFUSAL}")
    assert "--ssd-offload-create-dirs" in msg and "create_dirs: true" in msg
    assert os.listdir(tmp_path) == []  # not even nvme0


def test_the_root_is_the_path_above_the_first_job_component(tmp_path):
    # {local_rank} inside a drive's name is part of the root: that drive must be mounted.
    assert root_of("/mnt/nvme{local_rank}/ssdtrain/{job}/x", IDENT) == "/mnt/nvme0/ssdtrain"
    assert root_of("/scratch/{hostname}/{job}", IDENT) == "/scratch/node-a"
    assert root_of("/mnt/nvme0/ssdtrain", IDENT) == "/mnt/nvme0/ssdtrain"  # no {job}: all of it
    # Below an existing root the job folders are ours to create (and to remove).
    (tmp_path / "nvme0" / "ssdtrain").mkdir(parents=True)
    eng = _engine(tmp_path, [f"{tmp_path}/nvme{{local_rank}}/ssdtrain/{{job}}"])
    try:
        assert eng.rank_dirs[0].startswith(f"{tmp_path}/nvme0/ssdtrain/77/ssdtrain.77.node-a.rank0.")
    finally:
        eng.close()
    assert os.listdir(tmp_path / "nvme0" / "ssdtrain") == []  # the job folder went with the job


def test_create_dirs_creates_a_missing_root_and_says_so(tmp_path, caplog):
    root = tmp_path / "not-mounted" / "ssdtrain"
    with caplog.at_level(logging.WARNING, logger="ssdtrain_megatron.io.roots"):
        eng = _engine(tmp_path, [root], create_dirs=True)
    eng.close()
    assert root.is_dir() and oct(root.stat().st_mode & 0o777) == "0o700"
    assert f"created the offload root {root} (create_dirs)" in caplog.text


def test_a_root_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(LayoutError, match=r"offload root .*/f is not a directory"):
        check_roots([str(tmp_path / "f")], IDENT, create=True)


def test_the_flag_and_the_yaml_key_set_create_dirs(tmp_path):
    from ssdtrain_megatron.megatron.args import add_ssd_offload_args, config_from_args
    import argparse

    parser = add_ssd_offload_args(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args(["--ssd-offload", "--ssd-offload-create-dirs"])).create_dirs
    assert not config_from_args(parser.parse_args(["--ssd-offload"])).create_dirs
    preset = tmp_path / "p.yaml"
    preset.write_text("offload:\n  create_dirs: true\n")
    assert OffloadConfig.from_yaml(str(preset)).create_dirs


def test_the_start_line_names_device_and_free_space_and_warns_for_shared_drives(offload_dir, caplog):
    """Two roots in one folder lie on one drive; the folder is on the filesystem of / exactly
    when its device number is that of /. Broken variant (root_warnings' result dropped in
    roots.log_roots): the "striping over them gains nothing" assertion fails."""
    from ssdtrain_megatron.cache import ActivationOffloader

    a, b = offload_dir / "a", offload_dir / "b"
    a.mkdir()
    b.mkdir()
    import torch

    with caplog.at_level(logging.INFO, logger="ssdtrain_megatron.io.roots"):
        off = ActivationOffloader(OffloadConfig(dirs=[str(a), str(b)]), device=torch.device("cpu"))
    off.close()
    starts = [r.getMessage() for r in caplog.records if "offload files in" in r.getMessage()]
    assert len(starts) == 2 and all(" free of " in s and " on " in s and "(" in s for s in starts), starts
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("are on one drive" in w and "striping over them gains nothing" in w for w in warnings), warnings
    on_system = os.stat(offload_dir).st_dev == os.stat("/").st_dev
    assert any("on the same filesystem as /" in w for w in warnings) == on_system, warnings


def _doctor(capsys, *dirs):
    rc = main(["doctor", "--json", *sum((["--dir", str(d)] for d in dirs), [])])
    return rc, json.loads(capsys.readouterr().out)


def test_doctor_calls_a_missing_root_missing_and_fails(tmp_path, capsys):
    """Broken variant (root_report ignoring root_problem's "missing"): "assert [None] ==
    ['missing']"; before this change the doctor checked the deepest existing parent and said
    "missing; checked ... writable", exit 0."""
    rc, report = _doctor(capsys, tmp_path / "nvme9")
    assert rc == 1
    assert [r["problem"] for r in report["roots"]] == ["missing"]
    rc = main(["doctor", "--dir", str(tmp_path / "nvme9")])
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "nvme9" in ln)
    assert line.strip().startswith(f"{tmp_path}/nvme9: missing (mount the drive or create it")
    assert not (tmp_path / "nvme9").exists()


def test_doctor_checks_a_template_root_and_a_file_as_the_offloader_does(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o777)  # world-writable without the sticky bit
    rc, report = _doctor(capsys, tmp_path / "f", f"{tmp_path}/open/{{job}}", tmp_path)
    assert rc == 1
    problems = [r["problem"] for r in report["roots"]]
    assert problems[0] == "not a directory" and problems[2] is None
    assert problems[1].startswith("world-writable without the sticky bit")
    # The offloader refuses the same roots with the same words.
    with pytest.raises(LayoutError, match="is not a directory"):
        check_roots([str(tmp_path / "f")], IDENT)
    with pytest.raises(LayoutError, match="world-writable without the sticky bit"):
        check_roots([f"{tmp_path}/open/{{job}}"], IDENT)
