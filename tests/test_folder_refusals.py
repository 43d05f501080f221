"""Every refusal of a folder names the path, its owner and mode, and the fix (issue 65,
symptom 3); the DGX preset gives each user a folder of their own, so two users of one node
never meet in one folder.

The users' jobs run in forked children as throwaway users (useradd where the tests run as root,
skipped with the reason otherwise: as root every mode bit is ignored), through what a job's
engine does at its start (io/slab_engine.py: expand the roots, check them, creating a missing
one with create_dirs, make the rank directories). Each test fails on main a975649 (said per
test)."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.io.dirfd import LayoutError, open_chain, user_name
from ssdtrain_megatron.io.layout import Identity, expand_roots, make_rank_dirs
from ssdtrain_megatron.io.roots import check_roots
from tests.as_user import call_as, scratch_fixture, sh_as, users_fixture
from tests.test_scripts import NODE, REPO, stand_ins  # noqa: F401 (fixture)

FIX = ("where several users share a root, give each a folder of their own above {job} ({user} in the "
       "template: /raid/{user}/ssdtrain/{job}), or point --ssd-offload-dir (or the stats or trace path) "
       "elsewhere")


users = users_fixture("ssdt65f")
scratch = scratch_fixture("ssdt-raid-", 0o1777)  # root's, under /tmp (a /raid with the sticky bit)


def owner(user) -> str:
    return f"owner {user.name} (uid {user.uid})"


def start(template: str, job: str, create: bool = False) -> str:
    """What a job's engine does with ``template`` at its start, as the calling user; the
    rank directory it made (left in place: the job is still running)."""
    ident = Identity(rank=0, local_rank=0, hostname="node", job=job)
    roots = expand_roots([template], ident)
    check_roots([template], ident, create=create)
    return make_rank_dirs(roots, ident, [template])[0].path


def test_another_users_0700_job_folder_is_refused_naming_its_owner_mode_and_the_fix(users, scratch):
    """The attacker makes our ``{job}`` folder first, 0700. Main: ``PermissionError: [Errno 13]
    Permission denied: '4242'`` (no path, no owner, no fix)."""
    sh_as(users.attacker, f"mkdir -m 700 '{scratch}/4242'")
    template = f"{scratch}/{{job}}"
    assert call_as(users.victim, lambda: start(template, "4242")) == (
        "LayoutError", f"'{scratch}/4242' (from the template '{template}') cannot be used (Permission denied; "
                       f"{owner(users.attacker)}, mode 0700): another user's folder, or one we may not enter; {FIX}")


def test_a_folder_we_may_not_make_our_folder_in_is_refused_naming_it(users, scratch):
    """A root whose mode lets us in but not write (root's 0755): main raised the bare
    PermissionError of mkdir."""
    root = scratch / "ro"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    template = f"{root}/{{job}}"
    assert call_as(users.victim, lambda: start(template, "7")) == (
        "LayoutError", f"'{root}/7' (from the template '{template}') cannot be used (Permission denied; in "
                       f"{root}: owner root (uid 0), mode 0755): another user's folder, or one we may not enter; "
                       f"{FIX}")


def test_the_old_dgx_template_refuses_the_second_user_in_one_line(users, scratch):
    """``/raid/ssdtrain/{local_rank}/{job}`` with create_dirs on a 1777 /raid: the first user's
    job makes /raid/ssdtrain its own 0700 folder, and the second user's is refused. Main said
    ``PermissionError: [Errno 13] Permission denied: '/raid/ssdtrain'``; now the line names the
    folder, whose it is, its mode and the per-user fix (the preset's template, below)."""
    template = f"{scratch}/ssdtrain/{{local_rank}}/{{job}}"
    first = call_as(users.victim, lambda: start(template, "4242", create=True))
    assert first[0] == "ok" and first[1].startswith(f"{scratch}/ssdtrain/0/4242/ssdtrain.4242.node.rank0.pid")
    assert call_as(users.attacker, lambda: start(template, "4243", create=True)) == (
        "LayoutError", f"'{scratch}/ssdtrain' cannot be used (Permission denied; {owner(users.victim)}, mode "
                       f"0700): another user's folder, or one we may not enter; {FIX}")


def test_the_dgx_preset_gives_each_user_a_folder_so_two_users_share_the_node(users, scratch):
    """The preset's own dirs line, /raid being a root-owned 1777 folder, create_dirs on: both
    users' jobs start, each below a 0700 folder of its own, the second while the first runs.
    Broken on main (the preset's /raid/ssdtrain/{local_rank}/{job}): the second is refused."""
    [template] = OffloadConfig.from_yaml(os.path.join(REPO, "configs", "llama3-8b-dgx.yaml")).dirs
    assert template.startswith("/raid/")
    template = str(scratch) + template[len("/raid"):]
    for user, job in ((users.victim, "4242"), (users.attacker, "4242")):  # one job id, even
        answer = call_as(user, lambda: start(template, job, create=True))
        assert answer[0] == "ok", answer
        assert answer[1].startswith(f"{scratch}/{user.name}/ssdtrain/0/4242/ssdtrain.4242.node.rank0.pid")
        st = os.stat(scratch / user.name)
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (user.uid, 0o700)


def test_every_refusal_of_a_folder_names_its_owner_and_mode(tmp_path):
    """Group- or world-writable without the sticky bit, a file where a folder should be, a
    symlink where a job folder should be: main named neither the owner nor the mode."""
    me = f"owner {user_name(os.getuid())} (uid {os.getuid()})"
    for name, mode in (("group", 0o775), ("world", 0o777)):
        (tmp_path / name).mkdir()
        os.chmod(tmp_path / name, mode)
    (tmp_path / "ours").mkdir()
    (tmp_path / "ours" / "file").write_text("")
    os.chmod(tmp_path / "ours" / "file", 0o644)
    os.symlink(tmp_path / "world", tmp_path / "ours" / "link")
    found = []
    for path, base in ((tmp_path / "group" / "j", tmp_path / "group"), (tmp_path / "world" / "j", tmp_path / "world"),
                       (tmp_path / "ours" / "file", tmp_path / "ours"), (tmp_path / "ours" / "link", tmp_path / "ours")):
        with pytest.raises(LayoutError) as err:
            open_chain(str(path), create=False, base=str(base))
        found.append(str(err.value))
    assert found[0].startswith(f"offload root {str(tmp_path / 'group')!r} is group-writable without the sticky "
                               f"bit ({me}, mode 0775): any member can rename")
    assert found[1].startswith(f"offload root {str(tmp_path / 'world')!r} is world-writable without the sticky "
                               f"bit ({me}, mode 0777): anyone can rename")
    assert found[2] == f"{str(tmp_path / 'ours' / 'file')!r} is not a directory ({me}, mode 0644)"
    assert found[3] == (f"{str(tmp_path / 'ours' / 'link')!r} is a symlink where a job directory should be; refusing "
                        f"to follow it ({me}, mode 0777). Remove it, or put the link's target in dirs")


def test_the_node_script_fills_in_user_where_it_removes_the_job_folders(stand_ins):
    """scripts/ssdtrain_node.sh removes each local rank's ``{job}`` folder at the end; with
    ``{user}`` in SSD_DIRS it must name the same folder the offloader made. Broken on main (the
    literal "{user}" kept): the job folder stays behind."""
    env, tmp_path = stand_ins
    me = user_name(os.getuid())
    env["SSD_DIRS"] = f"{tmp_path}/mnt/{{user}}/nvme{{local_rank}}/ssdtrain/{{job}}"
    env["STUB_WRITES"] = f"{tmp_path}/mnt/{me}/nvme1/ssdtrain/4242"
    out = subprocess.run(["bash", NODE], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert os.listdir(tmp_path / "mnt" / me / "nvme1" / "ssdtrain") == []  # the job folder went, not the root
