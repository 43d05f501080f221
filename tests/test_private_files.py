"""Files and folders a job makes outside its rank directories stay private and never follow a
link someone put in their place: the stats and trace files (opened once, O_NOFOLLOW |
O_APPEND | O_CREAT, 0600), and the folder `ssdtrain demo --dir` (bench, io-bench) creates
(0700 whatever the umask). Real files, real umasks."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.io.dirfd import user_name
from ssdtrain_megatron.io.layout import LayoutError
from ssdtrain_megatron.tools.cli_types import writable_dir
from tests.models import mlp, run_steps


@pytest.fixture
def umask():
    """Set the process umask for the test (put back afterwards)."""
    before = os.umask(0o022)
    os.umask(before)
    yield os.umask
    os.umask(before)


def _me() -> str:
    return f"owner {user_name(os.getuid())} (uid {os.getuid()})"


def _mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def _offloader(tmp_path, **kw):
    (tmp_path / "nvme0").mkdir(mode=0o700, exist_ok=True)  # the drive, mounted private
    os.chmod(tmp_path / "nvme0", 0o700)
    return ActivationOffloader(OffloadConfig(dirs=[str(tmp_path / "nvme0")], min_tensor_bytes=1024,
                                             keep_last_layers=0, job="j", **kw), device=torch.device("cpu"))


def _steps(off, steps=1):
    model = mlp(width=64, depth=2)
    batches = [torch.randn(8, 64, generator=torch.Generator().manual_seed(i)) for i in range(1)]
    # every write lands before backward, so each step writes trace lines whatever the machine's
    # load (a write backward overtakes is cancelled and traces nothing)
    run_steps(model, batches, off, steps=steps, wait_writes=True)


@pytest.mark.parametrize("mask", [0o000, 0o022, 0o077])
def test_stats_and_trace_files_are_0600_whatever_the_umask(tmp_path, umask, mask):
    """Broken on main (open(path, "a"): 0666 less the umask, 0666 under umask 000)."""
    umask(mask)
    stats, trace = tmp_path / "out" / "stats-{rank}.jsonl", tmp_path / "out" / "trace-{rank}.jsonl"
    with _offloader(tmp_path, stats_path=str(stats), trace_path=str(trace)) as off:
        _steps(off)
    for path in (tmp_path / "out" / "stats-0.jsonl", tmp_path / "out" / "trace-0.jsonl"):
        assert _mode(path) == 0o600, (path, oct(_mode(path)))
        assert path.read_text().count("\n") >= 1


def test_a_symlink_swapped_in_after_the_first_step_gets_no_line(tmp_path):
    """The file is opened once: a link put in its place later (its folder is shared) receives
    nothing; the lines go on to the file the job opened. Broken on main (opened by path at
    every step, following links): the victim file grows."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    stats = tmp_path / "out" / "stats.jsonl"
    with _offloader(tmp_path, stats_path=str(stats)) as off:
        _steps(off)
        os.rename(stats, tmp_path / "out" / "moved.jsonl")
        os.symlink(victim, stats)
        _steps(off)
    assert victim.read_text() == "precious\n"
    assert (tmp_path / "out" / "moved.jsonl").read_text().count('"step"') == 2


def test_a_symlink_put_where_a_placeholder_names_the_file_before_the_first_step_is_refused(tmp_path):
    """Between the start's check (expand_file) and the first step a link appears: the first
    line is refused with the path and the setting named, never written through it (broken by
    dropping O_NOFOLLOW: the victim gets the line)."""
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (tmp_path / "out").mkdir()
    with _offloader(tmp_path, stats_path=str(tmp_path / "out" / "stats-{rank}.jsonl")) as off:
        os.symlink(victim, tmp_path / "out" / "stats-0.jsonl")
        with pytest.raises(LayoutError) as err:
            _steps(off)
    assert str(err.value) == (f"{str(tmp_path / 'out' / 'stats-0.jsonl')!r} (--ssd-offload-stats-path) is a "
                              f"symlink ({_me()}, mode 0777); refusing to follow it. Remove it, or name the file "
                              "itself in the path")
    assert victim.read_text() == "precious\n"


def test_a_fixed_stats_path_that_is_a_symlink_is_refused_at_start(tmp_path):
    """A link at a fixed path is never followed (issue 65: another user's link there made a
    root job append to a root-only file): refused at start, naming the path, the link's owner
    and the fix. Broken on main, which resolved it once and appended to its target."""
    target = tmp_path / "logs" / "stats.jsonl"
    target.parent.mkdir()
    target.write_text("")
    (tmp_path / "out").mkdir()
    os.symlink(target, tmp_path / "out" / "stats.jsonl")
    with pytest.raises(LayoutError) as err:
        _offloader(tmp_path, stats_path=str(tmp_path / "out" / "stats.jsonl"))
    assert str(err.value) == (f"{str(tmp_path / 'out' / 'stats.jsonl')!r} is a symlink ({_me()}, mode 0777); "
                              "refusing to follow it. Remove it, or name the file itself in the path")
    assert target.read_text() == ""


@pytest.mark.parametrize("mask", [0o000, 0o002, 0o022])
def test_the_demo_folder_and_its_missing_parents_are_made_0700_whatever_the_umask(tmp_path, umask, mask):
    """`ssdtrain demo --dir` (and bench, io-bench): broken on main, where os.makedirs made them
    0777 under umask 000, and the offloader then refused its own root as world-writable."""
    umask(mask)
    path = writable_dir("--dir", str(tmp_path / "a" / "b" / "demo"))
    assert path == str(tmp_path / "a" / "b" / "demo")
    for d in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "demo"):
        assert _mode(d) == 0o700, (d, oct(_mode(d)))
    # An existing folder keeps its mode: it is the user's.
    (tmp_path / "mine").mkdir(mode=0o755)
    os.chmod(tmp_path / "mine", 0o755)
    writable_dir("--dir", str(tmp_path / "mine"))
    assert _mode(tmp_path / "mine") == 0o755
