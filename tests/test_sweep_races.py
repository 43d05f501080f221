"""Safe on a shared node, part two (issue 65, symptoms 1 and 4): root's sweeps judge and remove
through one held descriptor, walk only the folders of the user they remove for, and stop at a
depth bound with one line.

The attack of symptom 1 is played with real users (made with useradd, removed after; skipped
with the reason where the tests do not run as root): a victim's running job (its owner.json
locked by a process of the victim's) in ``R/<job>`` under a root-owned 1777 ``R``, and an
attacker's fake dead rank directory with the same name in ``R/mal``. Between judging the fake
and removing it (the seam ``clean.between_judging_and_removing``, so the race is played every
time, not by timing) the attacker renames ``R/mal`` and leaves a symlink to the victim's job
folder in its place, with ``mv`` and ``ln -s`` run as that user. On main a975649 the removal
opened ``R/mal`` again and deleted the victim's files, through each of `ssdtrain clean ROOT`,
`clean --dirs 'R/{job}'`, `clean --older-than 1h ROOT` and a root job's start-up sweep.
"""

from __future__ import annotations

import logging
import os
import pwd
import subprocess
import tempfile
from types import SimpleNamespace

import pytest

from ssdtrain_megatron.io import clean
from ssdtrain_megatron.io.owner import boot_id
from tests.test_owner_lock import HOST, _age, _clean_cli, _record_dir
from tests.throwaway_users import throwaway_user

JOB = "4242"
PID = 4343
OTHER_BOOT = "another machine's boot id"


@pytest.fixture(scope="module")
def users():
    """Two throwaway users: ``mal`` plays the attacker, ``vic`` the victim."""
    with throwaway_user("ssdm") as mal, throwaway_user("ssdv") as vic:
        if mal is None or vic is None:
            pytest.skip("needs root and useradd to play two other users on the node")
        yield SimpleNamespace(mal=_user(mal), vic=_user(vic))


def _user(uid: int) -> SimpleNamespace:
    pw = pwd.getpwuid(uid)
    return SimpleNamespace(uid=uid, gid=pw.pw_gid, name=pw.pw_name)


def as_user(user, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", script], user=user.uid, group=user.gid, capture_output=True,
                          text=True, cwd="/")


@pytest.fixture
def scratch():
    """A directory under /tmp other users may traverse (pytest's tmp_path is 0700), holding a
    root-owned 1777 ``R``; removed with ``rm -rf`` (a 1,100-deep tree is too deep for rmtree)."""
    path = tempfile.mkdtemp(prefix="ssdt-sweep-", dir="/tmp")
    os.chmod(path, 0o755)
    os.mkdir(os.path.join(path, "R"))
    os.chmod(os.path.join(path, "R"), 0o1777)
    yield os.path.join(path, "R")
    subprocess.run(["rm", "-rf", path], check=True)


def _chown_tree(top: str, user) -> None:
    for dirpath, _dirnames, filenames in os.walk(top):
        os.chown(dirpath, user.uid, user.gid)
        for n in filenames:
            os.chown(os.path.join(dirpath, n), user.uid, user.gid)


def _files(directory: str) -> dict:
    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))}


@pytest.fixture
def victim(scratch, users):
    """The victim's running job: ``R/<job>/ssdtrain.<job>.<host>.rank0.pid<pid>``, its
    owner.json locked by a process of the victim's (``flock``) until the test ends."""
    d = _record_dir(os.path.join(scratch, JOB), pid=PID, job=JOB, boot=boot_id())
    _chown_tree(os.path.join(scratch, JOB), users.vic)
    os.chmod(os.path.join(scratch, JOB), 0o700)
    locker = subprocess.Popen(["flock", os.path.join(d, "owner.json"), "sh", "-c", "echo locked; exec cat"],
                              user=users.vic.uid, group=users.vic.gid, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert locker.stdout.readline() == "locked\n"
    before = _files(d)
    yield SimpleNamespace(dir=d, files=before)
    locker.stdin.close()
    locker.wait(60)
    locker.stdout.close()


ENTRY_POINTS = {
    "clean ROOT": lambda r: _clean_cli([r]),
    "clean --dirs R/{job}": lambda r: _clean_cli(["--dirs", os.path.join(r, "{job}")]),
    "clean --older-than 1h ROOT": lambda r: _clean_cli(["--older-than", "1h", r]),
    "start-up sweep": lambda r: (clean.sweep_before_start([], [os.path.join(r, "{job}")], HOST), 0)[1],
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_folder_swapped_for_a_symlink_after_judging_steers_no_removal(scratch, users, victim, entry,
                                                                        monkeypatch):
    """Broken by removing through a second open of the folder's path (main's ``_remove``):
    the victim's owner.json and slab.bin are deleted, its directory removed."""
    aged = entry.startswith("clean --older-than")
    fake = _record_dir(os.path.join(scratch, "mal"), pid=PID, job=JOB, boot=OTHER_BOOT if aged else boot_id())
    if aged:
        _age(fake, 7200)  # a fake record aged with utime: "nothing changed in it for 2.0 h"
    _chown_tree(os.path.join(scratch, "mal"), users.mal)
    assert os.path.basename(fake) == os.path.basename(victim.dir)
    seen = []

    def swap(item) -> None:
        seen.append(item.path)
        done = as_user(users.mal, f"mv {scratch}/mal {scratch}/mal.old && ln -s {scratch}/{JOB} {scratch}/mal")
        assert done.returncode == 0, done.stderr

    monkeypatch.setattr(clean, "between_judging_and_removing", swap)
    assert ENTRY_POINTS[entry](scratch) == 0
    assert seen == [fake]  # judged stale, then swapped: the race was played
    assert os.path.islink(os.path.join(scratch, "mal"))
    assert _files(victim.dir) == victim.files, "the victim's files were touched"
    assert os.listdir(os.path.join(scratch, "mal.old")) == []  # the fake went, through the held folder


def test_a_sweep_walks_only_the_folders_of_the_user_it_removes_for(scratch, users, capsys):
    """Root's `ssdtrain clean` below the victim's folder removes for the victim only: a folder
    and a rank directory of the attacker in there are left, and said in one line. Broken by
    walking every folder as root (main: both removed)."""
    home = os.path.join(scratch, "vic")
    own = _record_dir(os.path.join(home, "5"), pid=PID, job="5", boot=boot_id())
    _chown_tree(home, users.vic)
    planted = _record_dir(home, pid=PID, job="8", boot=boot_id())
    nested = _record_dir(os.path.join(home, "mal"), pid=PID, job="9", boot=boot_id())
    for path in (planted, os.path.join(home, "mal")):
        _chown_tree(path, users.mal)
    assert _clean_cli([scratch]) == 0
    out = capsys.readouterr().out
    assert not os.path.exists(own) and os.path.isdir(planted) and os.path.isdir(nested)
    assert (f"skipped  {planted} (owned by {users.mal.name} (uid {users.mal.uid}), not by "
            f"{users.vic.name}; 0 B)") in out.splitlines()
    assert (f"skipped 1 folder of another user than the one the sweep removes for, not walked "
            f"(first: {home}/mal)") in out.splitlines()


def test_a_tree_deeper_than_the_bound_costs_one_line_and_the_rest_is_cleaned(scratch, users, capsys):
    """1,100 folders deep under ROOT (the attacker's). Broken on main: RecursionError out of
    os.walk, and the real leftover beside it stayed."""
    deep = os.path.join(scratch, "deep")
    os.mkdir(deep)
    fd = os.open(deep, os.O_RDONLY | os.O_DIRECTORY)
    for _ in range(1100):
        os.mkdir("d", dir_fd=fd)
        below = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.fchown(below, users.mal.uid, users.mal.gid)
        os.close(fd)
        fd = below
    os.close(fd)
    os.chown(deep, users.mal.uid, users.mal.gid)
    dead = _record_dir(os.path.join(scratch, "7"), pid=PID, job="7", boot=boot_id())
    _chown_tree(os.path.join(scratch, "7"), users.vic)
    assert _clean_cli([scratch]) == 0
    out = capsys.readouterr().out.splitlines()
    assert not os.path.exists(os.path.join(scratch, "7"))
    first = deep + "/d" * 64
    assert f"skipped 1 folder deeper than 64 levels, not walked (first: {first})" in out


def test_the_start_up_sweep_judges_a_bounded_number_per_folder_and_says_so(scratch, users, monkeypatch, caplog):
    """Thousands of planted rank directories (in one folder, or in many) must not hold up every
    job's start: at most MAX_SWEEP_JUDGED are judged in all (3 here), the rest named in one
    line; `ssdtrain clean` judges all. Broken by dropping the bound (main: 5 judged), or by
    bounding each folder alone (5 judged)."""
    for pid in range(5):
        folder = os.path.join(scratch, "mal" if pid < 2 else "mal2")
        _record_dir(folder, pid=1000 + pid, job="mal", boot=OTHER_BOOT)
        _chown_tree(folder, users.mal)
    monkeypatch.setattr(clean, "MAX_SWEEP_JUDGED", 3, raising=False)  # main had no bound
    with caplog.at_level(logging.INFO, logger="ssdtrain_megatron"):
        found = clean.sweep_before_start([], [os.path.join(scratch, "{job}")], HOST)
    assert [os.path.basename(f.path) for f in found] == [f"ssdtrain.mal.{HOST}.rank0.pid{1000 + i}" for i in range(3)]
    first = os.path.join(scratch, "mal2", f"ssdtrain.mal.{HOST}.rank0.pid1003")
    assert ("the start-up sweep for dead jobs' leftovers skipped 2 rank directories past the start-up "
            f"sweep's bound, not judged (`ssdtrain clean` judges all) (first: {first})") in caplog.text
    assert len(clean.clean_tree(scratch, dry_run=True)) == 5


def test_a_symlink_below_root_is_not_followed_and_is_counted(scratch, users, capsys, tmp_path):
    """A symlink in a folder the sweep walks leads nowhere: the dead job it points at stays."""
    elsewhere = _record_dir(str(tmp_path), pid=PID, job="3", boot=boot_id())
    os.symlink(str(tmp_path), os.path.join(scratch, "link"))
    assert _clean_cli([scratch]) == 0
    assert os.path.isdir(elsewhere)
    assert f"skipped 1 symlink, not followed (first: {scratch}/link)" in capsys.readouterr().out.splitlines()


def test_the_seam_is_called_only_for_what_is_removed(tmp_path, monkeypatch):
    """A dry run never reaches the seam; a removal reaches it once per stale directory."""
    seen = []
    monkeypatch.setattr(clean, "between_judging_and_removing", lambda item: seen.append(item.path))
    d = _record_dir(str(tmp_path), pid=PID, job="1", boot=boot_id())
    clean.clean_root(str(tmp_path), dry_run=True)
    assert seen == []
    (item,) = clean.clean_root(str(tmp_path))
    assert seen == [d] and item.removed and not os.path.exists(d)
    assert os.listdir(tmp_path) == []


def test_a_users_sweep_does_not_walk_another_users_folder(scratch, users, monkeypatch, capsys):
    """Run by the victim (getuid says so; the files are real and really theirs): the attacker's
    folder is not walked, the victim's dead job goes. Broken by walking every folder whose
    owner is not root for anyone (walks_for)."""
    mine = _record_dir(os.path.join(scratch, "5"), pid=PID, job="5", boot=boot_id())
    _chown_tree(os.path.join(scratch, "5"), users.vic)
    theirs = _record_dir(os.path.join(scratch, "mal"), pid=PID, job="6", boot=boot_id())
    _chown_tree(os.path.join(scratch, "mal"), users.mal)
    monkeypatch.setattr(os, "getuid", lambda: users.vic.uid)
    assert _clean_cli([scratch]) == 0
    out = capsys.readouterr().out.splitlines()
    assert not os.path.exists(mine) and os.path.isdir(theirs)
    assert (f"skipped 1 folder of another user than the one the sweep removes for, not walked "
            f"(first: {scratch}/mal)") in out
    assert not any(theirs in line for line in out)


def test_a_rank_directory_replaced_after_judging_is_left_alone(scratch, users, monkeypatch, capsys):
    """The attacker swaps the judged directory itself for another one of the same name (its
    own, holding a file it wants gone): the device and inode differ from what was judged, so
    nothing in it is removed and the line says why. Broken by dropping the device+inode check
    in ``_remove_at``: the other directory's file is deleted."""
    fake = _record_dir(os.path.join(scratch, "mal"), pid=PID, job=JOB, boot=boot_id())
    _chown_tree(os.path.join(scratch, "mal"), users.mal)

    def swap(item) -> None:
        done = as_user(users.mal, f"mv {fake} {fake}.judged && mkdir {fake} && echo keep > {fake}/keep")
        assert done.returncode == 0, done.stderr

    monkeypatch.setattr(clean, "between_judging_and_removing", swap)
    assert _clean_cli([scratch]) == 1
    out = capsys.readouterr().out.splitlines()
    assert _files(fake) == {"keep": b"keep\n"}
    assert any(line.startswith(f"failed   {fake} (job {JOB}, rank 0, ") and
               line.endswith("): replaced by another directory after it was judged; left alone") for line in out), out
