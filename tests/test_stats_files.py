"""The stats and trace files in a folder other users can write to (issue 65, symptom 2): a
group's 2775 ``out/`` or a root-owned 1777 one. Played with a real second user (useradd where
the tests run as root, skipped with the reason otherwise): a link at a fixed stats path, a link
put where ``{job}`` names the stats folder after the start, a FIFO at the path, the other user's
own 0666 file at ``stats-{rank}.jsonl``; and the umask case (no second user needed): both
files in one ``{job}`` folder under umask 000/002. Each is refused in one line naming the path,
what is there, its owner and the fix, or (the umask) works; none hands a line to another
user's file, follows a link, or waits. Each fails on main a975649 (said per test).

The order of events is the test's own (start, then the other user's move, then the step); a
call that main would block in for ever (the FIFO) runs in a forked child with a deadline."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from ssdtrain_megatron.io.dirfd import LayoutError, user_name
from ssdtrain_megatron.io import private_file
from ssdtrain_megatron.io.layout import Identity, expand_file
from ssdtrain_megatron.telemetry.stats import append_line
from tests.as_user import call_as, scratch_fixture, sh_as, users_fixture
from tests.test_private_files import _mode, _offloader, _steps, umask  # noqa: F401 (fixture)

FLAG = "(--ssd-offload-stats-path)"


users = users_fixture("ssdt65s")
scratch = scratch_fixture("ssdt-stats-", 0o755)  # root's, under /tmp


def shared_out(scratch: Path, users, kind: str) -> Path:
    """``out/``: root's 1777 (a /tmp), or a 2775 project folder of the users' group."""
    out = scratch / "out"
    out.mkdir()
    if kind == "2775":
        os.chown(out, 0, users.gid)
    os.chmod(out, 0o1777 if kind == "1777" else 0o2775)
    return out


def owner(user) -> str:
    return f"owner {user.name} (uid {user.uid})"


def ident() -> Identity:
    return Identity(rank=0, local_rank=0, hostname="node", job="j")


def a_step_line(path: str) -> str:
    """What a job of the calling user does with a stats path at start and at its first line."""
    append_line(expand_file(path, ident()), {"step": 0})
    return "appended"


# -- another user's symlink at a fixed stats path ------------------------------------------------


@pytest.mark.parametrize("kind", ["1777", "2775"])
def test_a_root_job_never_follows_another_users_link_at_a_fixed_stats_path(users, scratch, kind):
    """Main resolved a link at a fixed path at the start and appended to its target: a root-only
    0600 file grew by the job's lines. Now refused at start (and, put there after the start, at
    the first line), naming the path, the link's owner and the fix."""
    out = shared_out(scratch, users, kind)
    secret = scratch / "secret"
    secret.write_text("root only\n")
    os.chmod(secret, 0o600)
    stats = out / "stats.jsonl"
    sh_as(users.attacker, f"ln -s '{secret}' '{stats}'")
    with pytest.raises(LayoutError) as err:
        _offloader(scratch, stats_path=str(stats))
    assert str(err.value) == (f"{str(stats)!r} is a symlink ({owner(users.attacker)}, mode 0777); refusing "
                              "to follow it. Remove it, or name the file itself in the path")
    os.unlink(stats)
    with _offloader(scratch, stats_path=str(stats)) as off:  # the link comes after the start
        sh_as(users.attacker, f"ln -s '{secret}' '{stats}'")
        with pytest.raises(LayoutError) as err:
            _steps(off)
    assert str(err.value) == (f"{str(stats)!r} {FLAG} is a symlink ({owner(users.attacker)}, mode 0777); "
                              "refusing to follow it. Remove it, or name the file itself in the path")
    assert secret.read_text() == "root only\n"


def test_a_users_job_never_follows_another_users_link_into_its_own_home(users, scratch):
    """The victim's job (a forked child running as the victim) and the attacker share a 2775
    folder; the attacker's link points at a file in the victim's home. Main appended the
    victim's lines to it; now refused, naming the link's owner."""
    out = shared_out(scratch, users, "2775")
    home = scratch / "home"
    home.mkdir(mode=0o700)
    os.chown(home, users.victim.uid, users.victim.gid)
    notes = home / "notes.txt"
    notes.write_text("mine\n")
    os.chown(notes, users.victim.uid, users.victim.gid)
    stats = out / "stats.jsonl"
    sh_as(users.attacker, f"ln -s '{notes}' '{stats}'")
    assert call_as(users.victim, lambda: a_step_line(str(stats))) == (
        "LayoutError", f"{str(stats)!r} is a symlink ({owner(users.attacker)}, mode 0777); refusing to "
                       "follow it. Remove it, or name the file itself in the path")
    assert notes.read_text() == "mine\n"


# -- a symlink where {job} names the stats folder, after the start -------------------------------


@pytest.mark.parametrize("kind", ["1777", "2775"])
def test_a_link_put_where_job_names_the_stats_folder_after_the_start_gets_no_file(users, scratch, kind):
    """Main made the stats folder at the first line with os.makedirs, which followed the link
    and created stats-0.jsonl in its target. Now the folder is walked without following links:
    the step stops with the path, the link's owner and the fix; the target stays empty."""
    out = shared_out(scratch, users, kind)
    elsewhere = scratch / "elsewhere"
    elsewhere.mkdir()
    with _offloader(scratch, stats_path=str(out / "{job}" / "stats-{rank}.jsonl")) as off:
        sh_as(users.attacker, f"ln -s '{elsewhere}' '{out}/j'")
        with pytest.raises(LayoutError) as err:
            _steps(off)
    assert str(err.value).startswith(
        f"{str(out / 'j')!r} {FLAG} is a symlink where a job directory should be; refusing to follow it "
        f"({owner(users.attacker)}, mode 0777). Remove it")
    assert os.listdir(elsewhere) == []


def test_a_stats_folder_swapped_for_a_link_between_steps_steers_nothing(users, scratch):
    """In a 2775 folder a group member may rename our ``{job}`` folder: after the first line it
    does, and leaves a link in its place. The file is held open: the second step's lines go to
    our file (in the renamed folder), none to the link's target. (Held on main as well: main
    opened the file once too; kept as the guard of that.)"""
    out = shared_out(scratch, users, "2775")
    elsewhere = scratch / "elsewhere"
    elsewhere.mkdir()
    with _offloader(scratch, stats_path=str(out / "{job}" / "stats-{rank}.jsonl")) as off:
        _steps(off)
        assert _mode(out / "j") == 0o700 and _mode(out / "j" / "stats-0.jsonl") == 0o600
        sh_as(users.attacker, f"mv -T '{out}/j' '{out}/j.moved' && ln -s '{elsewhere}' '{out}/j'")
        _steps(off)
    assert os.listdir(elsewhere) == []
    assert (out / "j.moved" / "stats-0.jsonl").read_text().count('"step"') == 2


def test_a_stats_folder_swapped_between_the_walk_and_the_open_steers_nothing(users, scratch, monkeypatch):
    """The race inside the first line, made deterministic by a hook between the walk to the
    folder and the open of the file (private_file.open_chain returns, then the group member
    renames our fresh ``{job}`` folder and leaves a link in its place): the file is opened
    relative to the folder's descriptor, so it is made in our folder, none in the target.
    (Main made the folder and opened the file by path: the file went through the link.)"""
    out = shared_out(scratch, users, "2775")
    elsewhere = scratch / "elsewhere"
    elsewhere.mkdir()
    real = private_file.open_chain

    def walk_then_swap(*args, **kw):
        chain = real(*args, **kw)
        sh_as(users.attacker, f"mv -T '{out}/j' '{out}/j.moved' && ln -s '{elsewhere}' '{out}/j'")
        return chain

    monkeypatch.setattr(private_file, "open_chain", walk_then_swap)
    with _offloader(scratch, stats_path=str(out / "{job}" / "stats-{rank}.jsonl")) as off:
        _steps(off)
    assert os.listdir(elsewhere) == []
    assert (out / "j.moved" / "stats-0.jsonl").read_text().count('"step"') == 1


# -- a FIFO at the path --------------------------------------------------------------------------


@pytest.mark.parametrize("who,mode", [("root", 0o666), ("victim", 0o600), ("victim", 0o666)])
def test_a_fifo_at_the_stats_path_is_refused_at_once(users, scratch, who, mode):
    """Put there after the start (the start's check passed). Main opened it for writing and
    blocked until someone read: the first step hung with no output (here: "hung" past the
    deadline); a 0600 FIFO of another user gave a non-root job a bare PermissionError. Now
    the open never waits (O_NONBLOCK) and the refusal names the path, the FIFO's owner and
    mode, and the fix."""
    out = shared_out(scratch, users, "1777")
    stats = out / "stats.jsonl"
    assert expand_file(str(stats), ident()) == str(stats)  # the start: nothing there yet
    sh_as(users.attacker, f"mkfifo -m {mode:o} '{stats}'")
    answer = call_as(None if who == "root" else users.victim,
                     lambda: append_line(str(stats), {"step": 0}) or "appended", deadline_s=30)
    assert answer == ("LayoutError", f"{str(stats)!r} is a FIFO ({owner(users.attacker)}, mode {mode:04o}); "
                                     "refusing to write to it. Remove it if someone put it there, or name "
                                     "another path")


# -- the other user's own file at stats-{rank}.jsonl ---------------------------------------------


@pytest.mark.parametrize("kind", ["1777", "2775"])
def test_another_users_file_at_the_stats_path_gets_no_line(users, scratch, kind):
    """The attacker's 0666 file where our ``stats-{rank}.jsonl`` goes. Main appended to it (the
    attacker read our lines); now refused at start, and at the first line when it is put there
    after the start, naming its owner and mode; it stays empty."""
    out = shared_out(scratch, users, kind)
    template, theirs = str(out / "stats-{rank}.jsonl"), out / "stats-0.jsonl"
    plant = f"touch '{theirs}' && chmod 666 '{theirs}'"
    why = (f"is another user's file ({owner(users.attacker)}, mode 0666); refusing to hand it our lines. "
           "Remove it if someone put it there, or name another path (a folder of your own, or {user} in "
           "the path)")
    sh_as(users.attacker, plant)
    with pytest.raises(LayoutError) as err:
        _offloader(scratch, stats_path=template)
    assert str(err.value) == f"{str(theirs)!r} (from the template {template!r}) {why}"
    os.unlink(theirs)
    with _offloader(scratch, stats_path=template) as off:
        sh_as(users.attacker, plant)
        with pytest.raises(LayoutError) as err:
            _steps(off)
    assert str(err.value) == f"{str(theirs)!r} {FLAG} {why}"
    assert theirs.read_text() == ""


# -- what needs no second user -------------------------------------------------------------------


@pytest.mark.parametrize("mask,setgid", [(0o000, False), (0o002, True)], ids=["umask000", "umask002-setgid"])
def test_stats_and_trace_in_one_job_folder_start_and_stay_private_under_umask(tmp_path, umask, mask, setgid):
    """Main made the trace folder 0777 (0775) with os.makedirs at the start, and then refused
    that folder, its own, when it checked the stats path in it: the job did not start. Now the
    folder is made 0700 through descriptors at the first line, whatever the umask or a setgid
    parent (which main's folder inherited: 2775)."""
    umask(mask)
    if setgid:
        (tmp_path / "out").mkdir()
        os.chmod(tmp_path / "out", 0o2755)
    folder = tmp_path / "out" / "{job}"
    with _offloader(tmp_path, stats_path=str(folder / "stats-{rank}.jsonl"),
                    trace_path=str(folder / "trace-{rank}.jsonl")) as off:
        _steps(off)
    made = tmp_path / "out" / "j"
    assert (_mode(tmp_path / "out"), _mode(made)) == (0o2755 if setgid else 0o700, 0o700)
    assert sorted(os.listdir(made)) == ["stats-0.jsonl", "trace-0.jsonl"]
    for name in ("stats-0.jsonl", "trace-0.jsonl"):
        assert _mode(made / name) == 0o600
        assert (made / name).read_text().count("\n") >= 1


def test_a_hard_link_at_the_stats_path_is_refused(tmp_path):
    """A file of ours with a second name (root can be made to own one: a link root made, or
    one made where protected_hardlinks is off) would get our lines under both names."""
    (tmp_path / "out").mkdir()
    mine = tmp_path / "kept.txt"
    mine.write_text("kept\n")
    os.chmod(mine, 0o644)
    os.link(mine, tmp_path / "out" / "stats.jsonl")
    with pytest.raises(LayoutError) as err:
        append_line(str(tmp_path / "out" / "stats.jsonl"), {"step": 0})
    assert str(err.value) == (f"{str(tmp_path / 'out' / 'stats.jsonl')!r} is a file with 2 hard links "
                              f"(owner {user_name(os.getuid())} (uid {os.getuid()}), mode 0644); our lines "
                              "would land in the other names too. Remove it, or name another path")
    assert mine.read_text() == "kept\n"
    assert stat.S_ISREG(os.lstat(mine).st_mode)
