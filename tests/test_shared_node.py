"""Safe on a shared node (issue 60, items 1, 4 and part of 5): no other user can steer where our
files go or which files our job deletes, a failed start undoes its directory, and a root that
vanishes or turns read-only is one line, never a raw OSError or a close() that raises.

The attacks of the issue are played with a real second user (made here with useradd, removed
after; skipped with the reason when the tests do not run as root): (a) a 1777 root another
user owns, (b) a ``{job}`` folder another user makes between our check and our use (the race
made deterministic by a hook where the start-up sweep runs), (c) a group-writable project root,
(d) a job folder widened by the umask (000, or 002 under a setgid root). In each, the other
user renames our directory and leaves a symlink to a third directory in its place; on main
2bcd1d4 the job went on through the link and its close deleted every plain file there.
"""

from __future__ import annotations

import errno
import grp
import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import tempfile
from types import SimpleNamespace

import pytest
import torch

from ssdtrain_megatron.cache.offloader import ActivationOffloader
from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.io import layout, owner, slab_engine
from ssdtrain_megatron.io.layout import Identity, LayoutError, make_rank_dir, remove_rank_dir
from ssdtrain_megatron.io.posix import PosixEngine
from ssdtrain_megatron.io.slab import SLAB_NAME, Slab
from ssdtrain_megatron.io.syscalls import OS
from tests import fake_kvikio

PRECIOUS = {"precious.txt": b"keep me", "thesis.tex": b"\\begin{document}"}


# -- a second user, and a scratch directory they can reach -------------------------------------


@pytest.fixture(scope="module")
def other():
    """A throwaway user ``name`` in a throwaway group ``group`` (removed after the module)."""
    if os.getuid() != 0:
        pytest.skip("needs root to create a second user with useradd (these tests play another "
                    "user on the node)")
    if shutil.which("useradd") is None:
        pytest.skip("useradd is not installed")
    tag = f"{os.getpid() % 100000}"
    group, name = f"ssdt60g{tag}", f"ssdt60u{tag}"
    subprocess.run(["groupadd", group], check=True, capture_output=True)
    try:
        subprocess.run(["useradd", "-M", "-N", "-g", group, "-s", "/bin/sh", name], check=True,
                       capture_output=True)
        try:
            yield SimpleNamespace(name=name, group=group, uid=pwd.getpwnam(name).pw_uid,
                                  gid=grp.getgrnam(group).gr_gid)
        finally:
            subprocess.run(["userdel", name], capture_output=True)
    finally:
        subprocess.run(["groupdel", group], capture_output=True)


def as_user(user, script: str) -> subprocess.CompletedProcess:
    """Run ``script`` (sh) as ``user``; its failure is the test's to judge, not raised."""
    return subprocess.run(["sh", "-c", script], user=user.uid, group=user.gid, extra_groups=[user.gid],
                          capture_output=True, text=True, cwd="/")


@pytest.fixture
def scratch():
    """A directory under /tmp that other users may traverse (pytest's tmp_path is 0700)."""
    path = tempfile.mkdtemp(prefix="ssdt-shared-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def third_dir(scratch: str) -> str:
    """Files our job's user may delete, outside every offload directory."""
    path = os.path.join(scratch, "third")
    os.mkdir(path, 0o700)
    for name, data in PRECIOUS.items():
        with open(os.path.join(path, name), "wb") as fh:
            fh.write(data)
    return path


def intact(third: str) -> bool:
    names = sorted(os.listdir(third))
    return names == sorted(PRECIOUS) and all(open(os.path.join(third, n), "rb").read() == PRECIOUS[n]
                                             for n in names)


def one_step(eng) -> None:
    data = torch.arange(3000, dtype=torch.int32)
    eng.write(0, data.view(torch.uint8)).result()
    out = torch.empty_like(data)
    eng.read(0, out.view(torch.uint8)).result()
    assert torch.equal(out.view(torch.uint8), data.view(torch.uint8))
    eng.release(0)
    eng.end_step()


def attacked_job(template: str, job: str, attack) -> str:
    """Start a posix engine on ``template``, run a step, let ``attack(rank_dir)`` run, run a
    step (the slab is made again), close. Returns the refusal's message, or '' if it started."""
    try:
        eng = PosixEngine(OffloadConfig(dirs=[template], job=job),
                          Identity(rank=0, local_rank=0, hostname="node", job=job))
    except LayoutError as exc:
        return str(exc)
    try:
        one_step(eng)
        attack(eng.rank_dirs[0])
        one_step(eng)
    finally:
        try:
            eng.close()
        except OSError as exc:  # main's close, after it deleted the third directory's files
            return f"close raised {exc!r}"
    return ""


def swap(user, victim: str, rank_dir: str, third: str):
    """``user`` moves ``victim`` (our rank directory or a folder above it) aside and leaves a
    symlink to ``third`` where our rank directory was."""
    return as_user(user, f"mv -T '{victim}' '{victim}.moved' && mkdir -p '{os.path.dirname(rank_dir)}' && "
                         f"ln -s '{third}' '{rank_dir}'")


# -- (a) (b) (c) (d): the attacks, with a real second user ------------------------------


def test_a_a_root_another_user_owns_is_refused_even_with_the_sticky_bit(other, scratch):
    """(a) Broken variant (the owner check of dirfd.trust_problem removed): the job starts, the
    root's owner swaps our directory for a link, and close deletes the third directory's files."""
    root = os.path.join(scratch, "raid")
    os.mkdir(root)
    os.chown(root, other.uid, other.gid)
    os.chmod(root, 0o1777)
    third = third_dir(scratch)
    msg = attacked_job(root, "a1", lambda d: swap(other, d, d, third))
    assert intact(third)
    assert msg.startswith(f"offload root {root} is owned by {other.name} (uid {other.uid}), not by us or root")
    assert "\n" not in msg and "mkdir -m 700" in msg
    assert sorted(os.listdir(root)) == []  # nothing of ours was made there


@pytest.mark.parametrize("when", ["before the start", "between the check and the use"])
def test_b_a_job_folder_another_user_makes_is_refused(other, scratch, monkeypatch, when):
    """(b) ``{job}`` under a root-owned 1777 root, made by another user. Made before the start
    it is refused before anything is swept there (expand_root); made between that check and
    our use (deterministic: a hook where the start-up sweep runs), the descriptor walk of
    make_rank_dir refuses it. Broken variant (make_rank_dir creating the job folder with
    os.makedirs(exist_ok=True) again, as main did): the job runs in the other user's folder,
    they swap our directory for a link, and close deletes the third directory's files."""
    root = os.path.join(scratch, "tmp")
    os.mkdir(root)
    os.chmod(root, 0o1777)
    third = third_dir(scratch)
    job_dir = os.path.join(root, "4242")
    plant = f"mkdir -m 755 '{job_dir}'"
    if when == "before the start":
        assert as_user(other, plant).returncode == 0
    else:
        real = slab_engine.sweep_before_start

        def sweep_after_a_plant(*args, **kw):
            assert as_user(other, plant).returncode == 0
            return real(*args, **kw)

        monkeypatch.setattr(slab_engine, "sweep_before_start", sweep_after_a_plant)
    msg = attacked_job(f"{root}/{{job}}", "4242", lambda d: swap(other, d, d, third))
    assert intact(third)
    assert msg.startswith(f"{job_dir!r} (from the template '{root}/{{job}}') is owned by {other.name}")
    assert "\n" not in msg
    assert os.listdir(job_dir) == [] and os.stat(job_dir).st_uid == other.uid  # theirs, untouched


def test_c_a_group_writable_root_is_refused(other, scratch):
    """(c) A project root 2775 whose group the other user is in. Broken variant (the
    group-writable check of dirfd.trust_problem removed): a group member swaps our directory
    and close deletes the third directory's files."""
    root = os.path.join(scratch, "project")
    os.mkdir(root)
    os.chown(root, 0, other.gid)
    os.chmod(root, 0o2775)
    third = third_dir(scratch)
    msg = attacked_job(root, "c1", lambda d: swap(other, d, d, third))
    assert intact(third)
    assert msg.startswith(f"offload root {root} is group-writable without the sticky bit")
    assert "chmod g-w" in msg and "\n" not in msg


@pytest.mark.parametrize("umask,setgid", [(0o000, False), (0o002, True)], ids=["umask000", "umask002-setgid"])
def test_d_our_job_folders_are_0700_whatever_the_umask(other, scratch, umask, setgid):
    """(d) Under umask 000 (or 002 under a setgid root) main made the job folder 0777 (2775),
    so anyone (the group) could swap the rank directory inside it. Broken variant (no fchmod
    after mkdir in dirfd.DirChain.step, or os.makedirs for the folders): the job folder is
    2775 under the setgid root and the group member's swap deletes the third directory's files."""
    root = os.path.join(scratch, "home")
    os.mkdir(root)
    os.chown(root, 0, other.gid)
    os.chmod(root, 0o2755 if setgid else 0o755)
    third = third_dir(scratch)
    job_dir = os.path.join(root, "d1")
    modes = {}

    def attack(rank_dir):
        modes["job"] = stat.S_IMODE(os.stat(job_dir).st_mode)
        modes["r0"] = stat.S_IMODE(os.stat(os.path.dirname(rank_dir)).st_mode)
        victim = os.path.dirname(rank_dir)  # r0, inside the job folder
        swap(other, victim, rank_dir, third)

    old = os.umask(umask)
    try:
        msg = attacked_job(f"{root}/{{job}}/r{{rank}}", "d1", attack)
    finally:
        os.umask(old)
    assert intact(third)
    assert msg == ""
    assert modes == {"job": 0o700, "r0": 0o700}


# -- by descriptor: what holds even when the path is changed by someone we cannot refuse --------


def test_a_swapped_rank_directory_steers_nothing(tmp_path):
    """Our own user (or root) swaps the rank directory for a link to a third directory (which
    holds a file named like our slab) while the job runs: the job's next slab and its close
    still act on the directory it made, and the third directory keeps its files. Broken
    variants: Slab creating slab.bin by path (the step fails on the other slab.bin), Slab
    removing it by path (the other slab.bin is deleted), RankDir.remove listing by path (the
    other slab.bin is deleted at close)."""
    (tmp_path / "root").mkdir()
    third = third_dir(str(tmp_path))
    os.mkdir(os.path.join(third, "sub"))
    with open(os.path.join(third, "sub", SLAB_NAME), "wb") as fh:  # a file by our slab's name
        fh.write(b"not yours")
    moved = {}

    def attack(rank_dir):
        moved["to"] = rank_dir + ".moved"
        os.rename(rank_dir, moved["to"])
        os.symlink(os.path.join(third, "sub"), rank_dir)

    msg = attacked_job(str(tmp_path / "root"), "s1", attack)
    assert open(os.path.join(third, "sub", SLAB_NAME), "rb").read() == b"not yours"
    assert sorted(os.listdir(os.path.join(third, "sub"))) == [SLAB_NAME]
    shutil.rmtree(os.path.join(third, "sub"))
    assert intact(third)
    assert msg == ""
    assert os.listdir(moved["to"]) == []  # our files went from where they were


def test_the_o_direct_probe_at_start_goes_through_the_held_directory(tmp_path, monkeypatch):
    """The posix engine's O_DIRECT probe file is made in the rank directory we hold even when
    its name was taken over just before (a file by the probe's name waits behind the link).
    Broken variant (posix.py probing ``self.rank_dirs``, the paths): the start fails with
    FileExistsError on the other directory's dio-probe.bin."""
    from ssdtrain_megatron.io import posix

    (tmp_path / "root").mkdir()
    other_dir = tmp_path / "other"
    other_dir.mkdir()
    (other_dir / "dio-probe.bin").write_bytes(b"not yours")
    real = posix.probe_dio_align

    def swapped_first(directory):
        (rank_dir,) = [os.path.join(tmp_path / "root", n) for n in os.listdir(tmp_path / "root")]
        os.rename(rank_dir, rank_dir + ".moved")
        os.symlink(other_dir, rank_dir)
        return real(directory)

    monkeypatch.setattr(posix, "probe_dio_align", swapped_first)
    eng = PosixEngine(OffloadConfig(dirs=[str(tmp_path / "root")], job="p1"), Identity(0, 0, "node", "p1"))
    eng.close()
    assert (other_dir / "dio-probe.bin").read_bytes() == b"not yours"


def test_aio_reads_and_gds_open_the_slab_we_hold_not_its_name(tmp_path):
    """DeepNVMe's reads and kvikio open a file by name: they get /proc/self/fd/N, which is the
    slab we hold even after its name was taken over. (DeepNVMe is not built here and kvikio
    needs CUDA: a recording stand-in for the aio handle and tests/fake_kvikio for gds.)
    Broken variant (aio_submit passing the path, or gds opening slab.path): the bytes read are
    the replacement's."""
    d = make_rank_dir(str(tmp_path / "root"), Identity(0, 0, "node", "g1"))
    slab = Slab(d, direct="off")
    try:
        fd = slab.ensure_open()
        os.pwrite(fd, b"ours" * 1024, 0)
        os.rename(os.path.join(d.path, SLAB_NAME), os.path.join(d.path, "moved"))
        with open(os.path.join(d.path, SLAB_NAME), "wb") as fh:
            fh.write(b"FAKE" * 1024)
        read = {}

        class Handle:
            def async_pread(self, stage, path, offset):
                with open(path, "rb") as fh:
                    fh.seek(offset)
                    read["bytes"] = fh.read(4)
                return 0

        assert OS.aio_submit(Handle(), False, None, fd, slab.path, 0) == 0
        assert read["bytes"] == b"ours"
        from ssdtrain_megatron.io.gds import GdsEngine

        GdsEngine._open_cufile(SimpleNamespace(_kvikio=fake_kvikio), slab)
        buf = fake_kvikio.np.zeros(4, dtype=fake_kvikio.np.uint8)
        slab.handle.pread(buf, 4, 0).get()
        assert bytes(buf) == b"ours"
        os.unlink(os.path.join(d.path, "moved"))
    finally:
        slab.drop()
        remove_rank_dir(d)


# -- what held, kept ----------------------------------------------------------------------------


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o077])
def test_directories_are_0700_and_files_0600_under_any_umask(tmp_path, umask):
    """Broken variant (os.makedirs for the job folders, as main): under umask 000 the job
    folder is 0777, under 022 0755."""
    (tmp_path / "root").mkdir()
    old = os.umask(umask)
    try:
        eng = PosixEngine(OffloadConfig(dirs=[f"{tmp_path}/root/{{job}}/r{{rank}}"], job="u1"),
                          Identity(0, 0, "node", "u1"))
        try:
            data = torch.arange(100, dtype=torch.int32)
            eng.write(0, data.view(torch.uint8)).result()
            rank_dir = eng.rank_dirs[0]
            made = [tmp_path / "root" / "u1", tmp_path / "root" / "u1" / "r0", rank_dir]
            assert {str(p): oct(stat.S_IMODE(os.stat(p).st_mode)) for p in made} == {
                str(p): "0o700" for p in made}
            files = {f: oct(stat.S_IMODE(os.stat(os.path.join(rank_dir, f)).st_mode)) for f in os.listdir(rank_dir)}
            assert files == {"owner.json": "0o600", SLAB_NAME: "0o600"}
        finally:
            eng.close()
    finally:
        os.umask(old)
    assert os.listdir(tmp_path / "root") == []


# -- item 5: a failed start undoes its directory ------------------------------------------------


def test_a_start_that_fails_after_mkdir_leaves_nothing(tmp_path, monkeypatch):
    """Broken variant (main's make_rank_dir: no undo between mkdir and owner.json): the rank
    directory and its job folder stay, and no sweep ever removes them (no owner.json)."""
    (tmp_path / "root").mkdir()

    def no_record(*a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(layout, "owner_record", no_record)
    with pytest.raises(OSError, match="No space left"):
        PosixEngine(OffloadConfig(dirs=[f"{tmp_path}/root/{{job}}"], job="f1"), Identity(0, 0, "node", "f1"))
    assert os.listdir(tmp_path / "root") == []


# -- item 4: a vanished or read-only root is one line -------------------------------------------


def test_a_rank_directory_removed_mid_job_is_one_line_and_close_does_not_raise(tmp_path):
    """Broken variant (space_shortfalls without its OSError guard, as main): the check before
    the next step raises statvfs's FileNotFoundError."""
    (tmp_path / "root").mkdir()
    off = ActivationOffloader(OffloadConfig(dirs=[str(tmp_path / "root")], job="v1"))
    try:
        rank_dir = off.rank_dirs[0]
        shutil.rmtree(tmp_path / "root")
        with pytest.raises(LayoutError) as err:
            off.check_free_space([1 << 20])
        msg = str(err.value)
        assert "\n" not in msg
        assert msg.startswith(f"offload directory {rank_dir} is gone (No such file or directory): it was "
                              "removed while the job ran")
        assert "unmounted" in msg
    finally:
        off.close()


@pytest.fixture
def tmpfs(scratch):
    if os.getuid() != 0:
        pytest.skip("needs root to mount a tmpfs and remount it read-only")
    mnt = os.path.join(scratch, "mnt")
    os.mkdir(mnt)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", mnt],
                      capture_output=True).returncode != 0:
        pytest.skip("mount -t tmpfs is not allowed here")
    yield mnt
    # lazy: a test that failed with a file still open there must not leave the mount behind
    subprocess.run(["umount", "-l", mnt], capture_output=True)


def test_a_root_turned_read_only_is_one_warning_and_close_does_not_raise(tmpfs, caplog):
    """Broken variant (RankDir.remove raising its OSError, as main): close() raises
    'Read-only file system' on owner.json."""
    eng = PosixEngine(OffloadConfig(dirs=[tmpfs], job="r1"), Identity(0, 0, "node", "r1"))
    rank_dir = eng.rank_dirs[0]
    data = torch.arange(100, dtype=torch.int32)
    eng.write(0, data.view(torch.uint8)).result()
    eng.release(0)
    eng.end_step()  # the slab closed (a file open for writing keeps a remount read-only busy)
    subprocess.run(["mount", "-o", "remount,ro", tmpfs], check=True)
    try:
        with caplog.at_level(logging.WARNING):
            eng.close()  # does not raise
        lines = [r.getMessage() for r in caplog.records if "read-only" in r.getMessage()]
        assert lines and all(f"offload directory {rank_dir} is on a read-only filesystem now" in m
                             for m in lines)
    finally:
        subprocess.run(["mount", "-o", "remount,rw", tmpfs], check=True)
    assert os.path.isdir(rank_dir)  # left, said so; `ssdtrain clean` takes it once writable


def _dead_rank_dir(root: str, job: str) -> str:
    from ssdtrain_megatron.io.layout import rank_dir_name

    p = subprocess.Popen(["true"])
    p.wait()  # a pid nobody has now
    host = Identity.detect("x").hostname
    d = os.path.join(root, rank_dir_name(job, host, 0, p.pid))
    os.makedirs(d, mode=0o700)
    with open(os.path.join(d, "owner.json"), "w") as fh:
        # as a job of this boot writes it, its lock let go with its process
        fh.write(json.dumps({"pid": p.pid, "hostname": host, "job": job, "rank": 0,
                             "boot_id": owner.boot_id(), "lock": "flock"}))
    return d


def test_a_fifo_or_a_hard_link_in_a_dead_jobs_directory_is_handled(tmp_path):
    """What held on main, kept: the sweep never opens a FIFO (it would hang) and keeps that
    directory, reported; a hard link to a file outside is removed as a name only, the file
    outside keeps its bytes."""
    from ssdtrain_megatron.io.clean import STALE, clean_root

    root = str(tmp_path / "root")
    fifo_dir = _dead_rank_dir(root, "fifo")
    os.mkfifo(os.path.join(fifo_dir, "slab.bin"))
    link_dir = _dead_rank_dir(root, "link")
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"keep me")
    os.link(outside, os.path.join(link_dir, "slab.bin"))
    found = {os.path.basename(i.path): i for i in clean_root(root)}
    fifo = found[os.path.basename(fifo_dir)]
    assert fifo.verdict == STALE and not fifo.removed and "not a plain file" in fifo.error
    assert os.path.exists(os.path.join(fifo_dir, "slab.bin"))
    assert found[os.path.basename(link_dir)].removed and not os.path.exists(link_dir)
    assert outside.read_bytes() == b"keep me" and os.stat(outside).st_nlink == 1
