"""`ssdtrain clean ROOT` removes the folders a dead job made and left empty, and no other.

Below a bare ROOT no template says which folders a job made: those are the ones from its rank
directory up to its ``{job}`` folder (named after the job id), owned by the job's user. Run as
root on a shared drive, main removed every folder a removal left empty up to ROOT: another
user's own ``/raid/alice`` went, and her next job was refused. Real users where we are root
(a throwaway user made and removed by the test), real directories."""

from __future__ import annotations

import json
import os

import pytest

from ssdtrain_megatron.io.layout import rank_dir_name
from ssdtrain_megatron.io.owner import boot_id
from tests.test_owner_lock import HOST, _clean_cli
from tests.throwaway_users import throwaway_user


@pytest.fixture
def alice():
    """A throwaway user's uid where we are root (removed afterwards); our own uid otherwise."""
    with throwaway_user("ssda") as uid:
        yield os.getuid() if uid is None else uid


def _dead_job_dir(folder, job, uid):
    """A dead job's rank directory in ``folder`` (made with its parents), all owned by ``uid``
    from ``chown_from`` down: what the job of that user left behind."""
    d = os.path.join(folder, rank_dir_name(job, HOST, 0, 4242))
    os.makedirs(d, mode=0o700)
    with open(os.path.join(d, "owner.json"), "w") as fh:
        json.dump({"pid": 4242, "hostname": HOST, "job": job, "rank": 0, "boot_id": boot_id(), "lock": "flock"}, fh)
    with open(os.path.join(d, "slab.bin"), "wb") as fh:
        fh.write(b"x" * 4096)
    return d


def _chown_tree(top, uid):
    for dirpath, dirnames, filenames in os.walk(top):
        os.chown(dirpath, uid, uid)
        for n in filenames:
            os.chown(os.path.join(dirpath, n), uid, uid)


def test_clean_of_a_shared_drive_keeps_another_users_own_folders(tmp_path, alice, capsys):
    """Broken by pruning up to ROOT again (main): alice and alice/ssdtrain are removed."""
    raid = tmp_path / "raid"
    raid.mkdir()
    os.chmod(raid, 0o1777)
    (raid / "alice").mkdir()
    d = _dead_job_dir(raid / "alice" / "ssdtrain" / "123", "123", alice)  # /raid/alice/ssdtrain/{job}
    _chown_tree(raid / "alice", alice)
    assert _clean_cli([str(raid)]) == 0
    out = capsys.readouterr().out
    assert not os.path.exists(d) and not (raid / "alice" / "ssdtrain" / "123").exists()
    assert "empty job folder" in out
    assert os.listdir(raid) == ["alice"] and os.listdir(raid / "alice") == ["ssdtrain"]
    assert os.listdir(raid / "alice" / "ssdtrain") == []


def test_a_job_folder_with_rank_folders_below_goes_whole(tmp_path, alice):
    """{job}/r{rank}: both levels were the job's (what held on main)."""
    raid = tmp_path / "raid"
    d = _dead_job_dir(raid / "7" / "r0", "7", alice)
    _chown_tree(raid, alice)
    assert _clean_cli([str(raid)]) == 0
    assert not os.path.exists(d) and os.listdir(raid) == []


def test_folders_not_named_after_the_job_or_not_the_jobs_users_stay(tmp_path, alice):
    """A template without {job} (/raid/bob/...): no folder is the job's. A {job} folder an
    admin made for the job (root's, where the job's user is another): not the job's to remove.
    Broken by pruning up to ROOT (main) or by dropping the owner test."""
    raid = tmp_path / "raid"
    a = _dead_job_dir(raid / "bob" / "nvme", "55", alice)
    _chown_tree(raid / "bob", alice)
    admin = alice != os.getuid()  # the admin's folder needs a second user: only where we are root
    if admin:
        b = _dead_job_dir(raid / "66", "66", alice)  # /raid/66 stays root's
        for p in (b, *(os.path.join(b, n) for n in os.listdir(b))):
            os.chown(p, alice, alice)
    assert _clean_cli([str(raid)]) == 0
    assert not os.path.exists(a) and os.listdir(raid / "bob") == ["nvme"]
    if admin:
        assert not os.path.exists(b) and sorted(os.listdir(raid)) == ["66", "bob"]
