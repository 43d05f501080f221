"""Jobs as clusters run them: restarts with the same command line, failed starts, and what a
hard-killed job leaves for `ssdtrain clean` to find from the top of the drive.

Real components throughout: the posix engine on the test's filesystem, real training
subprocesses killed with SIGKILL while their IO threads write, and the `ssdtrain clean` command
run as a process.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from torch import nn

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.io import layout
from ssdtrain_megatron.io.clean import clean_templates, template_roots
from ssdtrain_megatron.io.layout import Identity, LayoutError, expand_file, job_levels
from tests.drives import mount

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def files_under(path) -> list:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs)


def tree(path) -> list:
    """Every file and folder under ``path`` (relative), to compare before and after."""
    out = []
    for d, dirs, fs in os.walk(path):
        out += [os.path.relpath(os.path.join(d, n), path) + "/" for n in dirs]
        out += [os.path.relpath(os.path.join(d, n), path) for n in fs]
    return sorted(out)


def one_step(off: ActivationOffloader, seed: int = 0) -> None:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64))
    off.register_parameters(model.parameters())
    with off.microbatch(0):
        loss = model(torch.randn(16, 64)).pow(2).mean()
    off.wait_writes()  # on disk before backward releases them (a queued write would be cancelled)
    loss.backward()
    off.end_step()


def small(dirs, **kw) -> OffloadConfig:
    return OffloadConfig(dirs=[str(d) for d in dirs], min_tensor_bytes=0, keep_last_layers=0,
                         io_threads=2, chunk_bytes=1 << 20, **kw)


# -- restarts: the same command line again --------------------------------------------------


def test_a_restart_with_the_same_stats_and_trace_paths_appends(tmp_path):
    out = tmp_path / "out"
    stats, trace = str(out / "stats-{rank}.jsonl"), str(out / "trace-{rank}.jsonl")
    lines = []
    for run in range(2):  # the second run is a restart: the files exist
        with ActivationOffloader(small(mount(tmp_path / "ssd" / "{job}"), job="j1", stats_path=stats,
                                       trace_path=trace)) as off:
            one_step(off, seed=run)
            assert off.last_step_stats.bytes_offloaded > 0
        with open(out / "stats-0.jsonl") as fh:
            lines.append(fh.read().splitlines())
    first, second = lines
    assert len(first) == 2 and len(second) == 4  # a run header line, then its step
    assert second[:2] == first  # the first run's lines are kept as they were
    parsed = [json.loads(s) for s in second]
    assert ["run" in r for r in parsed] == [True, False, True, False]  # readers split runs here
    assert parsed[0]["run"]["config_digest"] == parsed[2]["run"]["config_digest"]  # same settings
    assert [r["step"] for r in parsed if "run" not in r] == [0, 0]
    with open(out / "trace-0.jsonl") as fh:
        ops = [json.loads(s)["op"] for s in fh]
    assert ops.count("write") >= 2 and ops.count("read") >= 2
    assert sorted(os.listdir(out)) == ["stats-0.jsonl", "trace-0.jsonl"]
    assert os.listdir(tmp_path / "ssd") == []  # the job folder went with each run; the drive stays


@pytest.mark.parametrize("field", ["stats_path", "trace_path"])
def test_a_directory_where_the_stats_file_should_be_fails_at_start_and_leaves_nothing(tmp_path, field):
    (tmp_path / "out" / "stats-0.jsonl").mkdir(parents=True)
    (tmp_path / "ssd").mkdir()  # the drive
    before = tree(tmp_path)
    with pytest.raises(LayoutError, match=r"stats-0\.jsonl' \(from the template .*\) is a directory \(owner .*, "
                                          r"mode \d{4}\); this setting names a file"):
        ActivationOffloader(small([tmp_path / "ssd" / "{job}" / "r{rank}"], job="j1",
                                  **{field: str(tmp_path / "out" / "stats-{rank}.jsonl")}))
    # The engine had made ssd/j1/r0/ssdtrain.j1...: all of it is gone again.
    assert tree(tmp_path) == before


def test_expand_file_refuses_a_symlink_whether_a_placeholder_names_it_or_not(tmp_path):
    """Issue 65: a link at a fixed path is refused too (main followed it)."""
    ident = Identity(rank=0, local_rank=0, hostname="h", job="j")
    target = tmp_path / "target.jsonl"
    target.write_text("")
    os.symlink(target, tmp_path / "s-0.jsonl")
    with pytest.raises(LayoutError, match=r"s-\{rank\}.jsonl'\) is a symlink \(owner "):
        expand_file(str(tmp_path / "s-{rank}.jsonl"), ident)
    with pytest.raises(LayoutError, match=r"s-0.jsonl' is a symlink \(owner .*, mode 0777\); "
                                          "refusing to follow it. Remove it, or name the file itself"):
        expand_file(str(tmp_path / "s-0.jsonl"), ident)
    target.rename(tmp_path / "s-1.jsonl")  # a plain file of ours, 0644: appended to
    assert expand_file(str(tmp_path / "s-1.jsonl"), ident) == str(tmp_path / "s-1.jsonl")
    assert expand_file(str(tmp_path / "{job}" / "s.jsonl"), ident) == str(tmp_path / "j" / "s.jsonl")


# -- a failed start leaves nothing on disk ----------------------------------------------------


def _fail_tracer(monkeypatch):
    import ssdtrain_megatron.cache.offloader as mod

    def boom(*a, **k):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(mod, "IOTracer", boom)
    return OSError


def _fail_worker_buffers(monkeypatch):
    import ssdtrain_megatron.io.posix as mod

    calls = []

    def second_fails(n):
        calls.append(n)
        if len(calls) == 2:
            raise MemoryError("injected: cannot allocate the second bounce buffer")
        return torch.empty(n, dtype=torch.uint8)

    monkeypatch.setattr(mod, "aligned_buffer", second_fails)
    return MemoryError


def _fail_second_root(monkeypatch):
    real = layout.make_rank_dir

    def fails_on_b(root, ident, *template):
        if root.endswith("/b/j1"):
            raise LayoutError("injected: root b refused")
        return real(root, ident, *template)

    monkeypatch.setattr(layout, "make_rank_dir", fails_on_b)
    return LayoutError


def _fail_throttle(monkeypatch):
    import ssdtrain_megatron.io.throttle as mod

    def boom(*a, **k):
        raise RuntimeError("injected: throttle")

    monkeypatch.setattr(mod, "ThrottledEngine", boom)
    return RuntimeError


@pytest.mark.parametrize("inject", [_fail_tracer, _fail_worker_buffers, _fail_second_root, _fail_throttle],
                         ids=["trace-file", "engine-threads", "second-root", "throttle"])
def test_a_failure_anywhere_in_construction_leaves_nothing_on_disk(tmp_path, monkeypatch, inject):
    error = inject(monkeypatch)
    for drive in ("a", "b"):  # the drives exist; the job folders below them do not yet
        (tmp_path / drive).mkdir()
    before = tree(tmp_path)
    threads = set(threading.enumerate())
    with pytest.raises(error):
        ActivationOffloader(small([tmp_path / "a" / "{job}", tmp_path / "b" / "{job}"], job="j1",
                                  trace_path=str(tmp_path / "a" / "trace-{rank}.jsonl"),
                                  bandwidth_cap_gbps=100.0))
    assert tree(tmp_path) == before, "a failed start left files or folders behind"
    time.sleep(0.1)
    assert not [t for t in set(threading.enumerate()) - threads if t.name.startswith("ssdtrain")]


def test_a_failure_inside_megatron_install_leaves_nothing_on_disk_and_megatron_as_it_was(tmp_path, monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.transformer_layer import TransformerLayer

    inst = importlib.import_module("ssdtrain_megatron.megatron.install")  # the module, not the function

    def boom(*a, **k):
        raise RuntimeError("injected: a patch point is missing")

    monkeypatch.setattr(inst, "PipelineHooks", boom)
    (tmp_path / "ssd").mkdir()
    before = tree(tmp_path)
    forward, step = vars(TransformerLayer)["forward"], vars(schedules)["forward_step"]
    with pytest.raises(RuntimeError, match="injected"):
        inst.install(small([tmp_path / "ssd" / "{job}"], job="j3",
                           stats_path=str(tmp_path / "ssd" / "{job}-stats.jsonl")))
    assert tree(tmp_path) == before
    assert inst.installed() is None
    assert vars(TransformerLayer)["forward"] is forward and vars(schedules)["forward_step"] is step


def test_a_normal_close_removes_the_job_folders_it_made_and_not_the_shared_ones(tmp_path):
    shared = tmp_path / "nvme0" / "ssdtrain"
    shared.mkdir(parents=True)
    with ActivationOffloader(small([str(shared / "{job}" / "r{rank}")], job="j7")) as off:
        one_step(off)
        assert os.path.isdir(shared / "j7" / "r0")
    assert os.listdir(shared) == []
    assert job_levels("/mnt/nvme{local_rank}/ssdtrain/{job}") == 1
    assert job_levels("/scratch/{job}/r{rank}") == 2
    assert job_levels("/mnt/nvme0/{rank}") == 0


# -- a hard-killed job, and `ssdtrain clean` from the top ----------------------------------

WRITER = r"""
import json, os, sys, time
import torch
from torch import nn
from ssdtrain_megatron import ActivationOffloader, OffloadConfig

mode, job, template = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.GELU()) for _ in range(4)])
x = torch.randn(64, 512)
cfg = OffloadConfig(dirs=[template], job=job, min_tensor_bytes=4096, keep_last_layers=0,
                    io_threads=2, chunk_bytes=1 << 20)
with ActivationOffloader(cfg) as off:
    off.register_parameters(model.parameters())
    with off.microbatch(0):
        loss = model(x).pow(2).mean()
    loss.backward()
    off.end_step()  # one whole step first: offload works here
    print(json.dumps({"dirs": off.rank_dirs, "pid": os.getpid()}), flush=True)
    k = 0
    while True:  # then write for ever: forward only, each output dropped (its extents freed)
        with off.microbatch(k):
            out = model(x)
        if mode == "hold":
            off.wait_writes()
            time.sleep(3600)
        del out
        k += 1
"""


class Writer:
    def __init__(self, mode: str, job: str, template: str, rank: int) -> None:
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   RANK=str(rank), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-c", WRITER, mode, job, template], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)

    def ready(self, timeout: float = 120) -> dict:
        out: list = []
        t = threading.Thread(target=lambda: out.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not out or not out[0]:
            self.proc.kill()
            raise AssertionError(f"writer failed to start: {self.proc.stderr.read()}")
        return json.loads(out[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(60)
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()


@pytest.fixture
def writers():
    started = []

    def start(mode, job, template, rank=0):
        w = Writer(mode, job, template, rank)
        started.append(w)
        return w

    yield start
    for w in started:
        w.stop()


def ssdtrain_clean(*args: str) -> subprocess.CompletedProcess:
    """`ssdtrain clean ...`, the installed command (or its module where none is installed)."""
    exe = os.path.join(os.path.dirname(sys.executable), "ssdtrain")
    cmd = [exe, "clean"] if os.path.exists(exe) else [sys.executable, "-m", "ssdtrain_megatron.tools", "clean"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120, cwd=REPO)


def _kill_both_ranks_while_writing(tmp_path, writers):
    ssd = tmp_path / "ssd"
    for lr in ("lr0", "lr1"):  # the drives of local ranks 0 and 1
        (ssd / lr).mkdir(parents=True, exist_ok=True)
    template = str(ssd / "lr{local_rank}" / "{job}")
    ranks = [writers("write", "4711", template, rank=r) for r in (0, 1)]
    dead = [w.ready()["dirs"][0] for w in ranks]
    time.sleep(0.5)  # both are writing now
    for w in ranks:
        os.kill(w.proc.pid, signal.SIGKILL)  # what an OOM kill or a node failure does
        assert w.proc.wait(60) == -signal.SIGKILL
    for d in dead:
        assert sorted(os.listdir(d)) == ["owner.json", "slab.bin"]
        assert os.path.getsize(os.path.join(d, "slab.bin")) > 0
    return ssd, template, dead


def test_clean_from_the_drive_root_finds_a_hard_killed_jobs_slabs_and_keeps_a_live_job(tmp_path, writers):
    # The live job starts first (a job starting later would sweep the dead one's files itself).
    (tmp_path / "ssd" / "lr0").mkdir(parents=True)  # the drive of local rank 0
    live = writers("hold", "live9", str(tmp_path / "ssd" / "lr{local_rank}" / "{job}"), rank=0)
    live_dir = live.ready()["dirs"][0]
    ssd, template, dead = _kill_both_ranks_while_writing(tmp_path, writers)
    (ssd / "lr0" / "not-a-job").mkdir()  # an empty folder that was there before: not ours to remove
    live_files = {f: os.path.getsize(os.path.join(live_dir, f)) for f in os.listdir(live_dir)}

    dry = ssdtrain_clean("--dry-run", str(ssd))
    assert dry.returncode == 0, dry.stderr
    assert dry.stdout.count("would remove") == 2 and "2 stale directories" in dry.stdout, dry.stdout
    assert "live " in dry.stdout and all(os.path.isdir(d) for d in dead)

    done = ssdtrain_clean(str(ssd))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("removed ") >= 2 and "2 stale directories, freed" in done.stdout, done.stdout
    assert not any(os.path.exists(d) for d in dead)
    # The job folders the removal left empty are gone (the {job} folders 4711); the drives'
    # folders (lr1 held only the dead job, but the job did not make it), the live job's files,
    # and the folder that was empty before, are untouched.
    assert sorted(os.listdir(ssd)) == ["lr0", "lr1"] and os.listdir(ssd / "lr1") == []
    assert sorted(os.listdir(ssd / "lr0")) == ["live9", "not-a-job"]
    assert {f: os.path.getsize(os.path.join(live_dir, f)) for f in os.listdir(live_dir)} == live_files
    assert live.proc.poll() is None

    again = ssdtrain_clean(str(ssd))
    assert again.returncode == 0 and "0 stale directories" in again.stdout


def test_clean_from_the_presets_templates_and_at_the_next_start(tmp_path, writers):
    ssd, template, dead = _kill_both_ranks_while_writing(tmp_path, writers)
    preset = tmp_path / "preset.yaml"
    preset.write_text(f"model: {{num_layers: 2}}\noffload:\n  dirs: [{json.dumps(template)}]\n")
    assert sorted(template_roots(template)) == sorted(os.path.dirname(d) for d in dead)
    dry = ssdtrain_clean("--dry-run", "--config", str(preset))
    assert dry.returncode == 0 and dry.stdout.count("would remove") == 2, dry.stdout + dry.stderr
    # Another job id starting on the same templates sweeps the dead job's directories too,
    # and the job folders (the {job} component) they leave empty; lr0 and lr1 stay.
    with ActivationOffloader(small([template], job="next")) as off:
        assert not any(os.path.exists(d) for d in dead)
        assert sorted(os.listdir(ssd / "lr0")) == ["next"] and os.listdir(ssd / "lr1") == []
        one_step(off)
    assert os.listdir(ssd / "lr0") == [] and os.listdir(ssd / "lr1") == []
    assert ssdtrain_clean("--config", str(preset)).stdout.startswith("0 stale directories")


def test_clean_needs_a_root_or_templates_and_says_so():
    out = ssdtrain_clean()
    assert out.returncode == 2
    assert "name at least one ROOT, or --config PRESET, or --dirs TEMPLATES" in out.stderr


def test_clean_templates_leave_other_hosts_alone(tmp_path):
    d = tmp_path / "ssd" / "other-host" / "j1"
    d.mkdir(parents=True)
    assert template_roots(str(tmp_path / "ssd" / "{hostname}" / "{job}")) == []
    assert clean_templates([str(tmp_path / "ssd" / "{hostname}" / "{job}")]) == []
    assert d.is_dir()
