"""The `ssdtrain` command as a new user meets it: fast --help, one-line errors with the right exit
status (2 usage, 1 environment), tracebacks only on request, Ctrl-C that says what it removed."""

import errno
import json
import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from ssdtrain_megatron.tools import cli, cli_types
from tests.cli_helpers import run_cli

COMMANDS = ["demo", "doctor", "plan", "lifespan", "bench", "core-bench", "report", "io-bench", "clean"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _help_in_fresh_interpreter(args):
    """(CPU seconds, wall seconds, imported torch?, exit status) of ``ssdtrain ARGS --help`` in
    a new process. CPU time (user + system of the child) is what --help costs; unlike wall
    time it hardly grows when other jobs load the machine."""
    code = ("import sys, json\n"
            "from ssdtrain_megatron.tools.cli import main\n"
            "try:\n"
            f"    main({args!r} + ['--help'])\n"
            "except SystemExit as e:\n"
            "    rc = e.code\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'rc': rc}))\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return cpu, wall, got["torch"], got["rc"]


@pytest.mark.parametrize("command", [None] + COMMANDS)
def test_help_imports_no_torch_and_answers_at_once(command):
    """--help builds every parser: none may import torch (about 2-3 CPU seconds, 3-8 s of wall
    time on a loaded machine). Here it costs about 0.2 CPU seconds; the bound is CPU time, so
    other jobs on a shared machine do not make it fail, and the torch check bites first."""
    cpu, wall, torch_imported, rc = _help_in_fresh_interpreter([command] if command else [])
    name = f"`ssdtrain {command + ' ' if command else ''}--help`"
    assert rc == 0
    assert not torch_imported, f"{name} imported torch"
    assert cpu < 1.0, f"{name} used {cpu:.2f} CPU seconds ({wall:.2f} s wall)"
    assert wall < 60, f"{name} took {wall:.2f} s"


def test_every_command_is_listed_in_the_top_level_help(capsys):
    rc, out, _ = run_cli(["--help"], capsys)
    assert rc == 0
    for command in COMMANDS:
        assert f"    {command}" in out


# -- one line per mistake -------------------------------------------------------------------


def _one_line(err):
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_an_unknown_flag_is_one_line_with_exit_2(capsys):
    rc, out, err = run_cli(["demo", "--stpes", "2"], capsys)
    assert rc == 2 and out == ""
    assert _one_line(err) == ("ssdtrain demo: error: unrecognized arguments: --stpes 2 "
                              "(see ssdtrain demo --help)")


def test_a_bad_flag_value_names_the_flag(capsys):
    rc, _, err = run_cli(["demo", "--steps", "0"], capsys)
    assert rc == 2
    assert _one_line(err) == ("ssdtrain demo: error: argument --steps: expected a positive integer, "
                              "got 0 (see ssdtrain demo --help)")


def test_demo_dir_that_is_a_file_is_a_usage_error(tmp_path, capsys):
    f = tmp_path / "FILE"
    f.write_text("x")
    rc, out, err = run_cli(["demo", "--dir", str(f)], capsys)
    assert rc == 2 and out == ""
    assert _one_line(err) == (f"ssdtrain demo: --dir {f}: is a file, not a directory; give a directory "
                              "(it is created if missing)")


def test_demo_dir_under_a_file_is_a_usage_error(tmp_path, capsys):
    f = tmp_path / "FILE"
    f.write_text("x")
    rc, _, err = run_cli(["demo", "--dir", str(f / "sub")], capsys)
    assert rc == 2
    assert _one_line(err) == (f"ssdtrain demo: --dir {f / 'sub'}: lies under {f}, which is a file, not a "
                              "directory; give a directory (it is created if missing)")


def test_a_directory_that_cannot_be_written_is_an_environment_error(capsys):
    """/sys refuses new files even to root (sysfs): a real refusal, no fake."""
    target = "/sys/ssdtrain-test"
    if os.access("/sys", os.W_OK) and not os.path.isdir("/sys/kernel"):
        pytest.skip("no sysfs here")
    rc, out, err = run_cli(["bench", "--dir", target], capsys)
    assert rc == 1 and out == ""
    line = _one_line(err)
    assert line.startswith(f"ssdtrain bench: --dir {target}: cannot create it: "), line
    assert ("permission denied" in line or "operation not permitted" in line), line


def test_a_read_only_filesystem_says_so(tmp_path, capsys, monkeypatch):
    """EROFS needs a read-only mount, which the tests do not make (it takes privileges): the
    probe write is made to fail with EROFS, the rest is the real code path."""
    def read_only(directory):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), directory)

    monkeypatch.setattr(cli_types, "_probe_file", read_only)
    rc, _, err = run_cli(["demo", "--dir", str(tmp_path)], capsys)
    assert rc == 1
    assert _one_line(err) == (f"ssdtrain demo: --dir {tmp_path}: cannot write files there: the filesystem "
                              "is read-only; choose a directory on a writable drive")


def test_an_engine_without_its_library_fails_before_any_training(tmp_path, capsys, monkeypatch):
    """engine aio where libaio is missing (the availability probe answers as it does there)."""
    from ssdtrain_megatron.io import aio

    monkeypatch.setattr(aio.AioEngine, "is_available", classmethod(lambda cls: (False, "libaio-dev is not installed")))
    rc, out, err = run_cli(["demo", "--dir", str(tmp_path / "d"), "--engine", "aio"], capsys)
    assert rc == 1
    assert _one_line(err) == ("ssdtrain demo: --engine aio: cannot run here: libaio-dev is not installed "
                              "(ssdtrain doctor lists what runs here)")
    assert "losses" not in out


def test_a_bad_preset_value_is_one_line_with_exit_2(tmp_path, capsys):
    preset = tmp_path / "p.yaml"
    preset.write_text("offload:\n  io_threads: 0\n")
    rc, _, err = run_cli(["demo", "--dir", str(tmp_path / "d"), "--config", str(preset)], capsys)
    assert rc == 2
    assert _one_line(err).startswith("ssdtrain demo: ") and "io_threads=0 is invalid" in err


def test_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    f = tmp_path / "FILE"
    f.write_text("x")
    with pytest.raises(cli_types.UsageError, match="is a file"):
        cli.main(["--debug", "demo", "--dir", str(f)])
    with pytest.raises(cli_types.UsageError):
        cli.main(["demo", "--dir", str(f), "--debug"])
    monkeypatch.setenv("SSDTRAIN_DEBUG", "1")
    with pytest.raises(cli_types.UsageError):
        cli.main(["demo", "--dir", str(f)])


def test_an_unexpected_error_is_one_line_that_points_at_debug(capsys, monkeypatch):
    from ssdtrain_megatron.tools.plan import cli as plan_cli

    def broken(args):
        raise TypeError("unsupported operand")

    monkeypatch.setattr(plan_cli, "run_lifespan", broken)  # the parser is built after this
    rc, _, err = run_cli(["lifespan", "--drives", "1", "--tbw-per-drive", "1", "--write-gbps", "1",
                          "--write-fraction", "1"], capsys)
    assert rc == 1
    assert _one_line(err) == ("ssdtrain lifespan: TypeError: unsupported operand (--debug or SSDTRAIN_DEBUG=1 "
                              "shows the traceback)")


def test_deprecated_spellings_work_and_say_so(capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["demo", "--layers", "3", "--micro-batches", "5"])
    assert args.num_layers == 3 and args.num_microbatches == 5
    err = capsys.readouterr().err
    assert "--layers is deprecated, use --num-layers" in err
    assert "--micro-batches is deprecated, use --num-microbatches" in err
    rc, out, _ = run_cli(["demo", "--help"], capsys)
    assert "--micro-batches" not in out and "--num-microbatches" in out


def test_one_micro_batch_vocabulary_across_commands(capsys):
    """Megatron's names everywhere: --micro-batch-size, --num-microbatches."""
    for command, flags in (("demo", ("--micro-batch-size", "--num-microbatches", "--num-layers")),
                           ("plan", ("--micro-batch-size", "--num-microbatches")),
                           ("bench", ("--micro-batch-size", "--num-microbatches", "--num-layers"))):
        rc, out, _ = run_cli([command, "--help"], capsys)
        assert rc == 0
        for flag in flags:
            assert flag in out, (command, flag)
        for old in ("--micro-batches", "--num-micro-batches", "--micro-batch "):
            assert old not in out, (command, old)


# -- progress ---------------------------------------------------------------------------------


class _Terminal:
    def __init__(self):
        self.text = ""

    def write(self, s):
        self.text += s

    def flush(self):
        pass

    def isatty(self):
        return True


def test_progress_shows_rate_and_time_left_on_a_terminal(monkeypatch):
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    bar = cli_types.progress(4, desc="demo", unit="step", mininterval=0)
    for _ in range(2):
        time.sleep(0.05)
        bar.update(1)
    bar.close()
    assert "demo" in term.text and "2/4" in term.text
    assert "step/s" in term.text or "s/step" in term.text  # the rate
    assert "<" in term.text  # elapsed<remaining


def test_progress_is_silent_when_stderr_is_not_a_terminal(capsys):
    bar = cli_types.progress(4, desc="demo", unit="step")
    bar.update(4)
    bar.close()
    assert capsys.readouterr().err == ""


# -- doctor -----------------------------------------------------------------------------------


def test_doctor_reports_what_runs_here(tmp_path, capsys):
    rc, out, err = run_cli(["doctor", "--dir", str(tmp_path), "--json"], capsys)
    assert rc == 0, err
    r = json.loads(out)
    import torch

    assert r["torch"]["version"] == torch.__version__
    assert r["torch"]["cuda_available"] == torch.cuda.is_available()
    assert r["packages"]["megatron-core"].startswith("0.16")
    assert set(r["engines"]) == {"posix", "aio", "gds", "memory", "tiered"}
    assert r["engines"]["posix"] == {"available": True, "why_not": None}
    if not torch.cuda.is_available():
        assert r["engines"]["gds"]["available"] is False and r["engines"]["gds"]["why_not"]
    root = r["roots"][0]
    assert root["root"] == str(tmp_path) and root["writable"] is True
    assert root["free_bytes"] > 0 and root["filesystem"] != "unknown"
    assert set(r["memory"]) == {"host_memory_bytes", "cpus", "memlock_soft", "memlock_hard", "staging_default_bytes"}
    assert r["memory"]["staging_default_bytes"] == 2 << 30  # 2 x max_inflight_bytes, what the line names
    assert os.listdir(tmp_path) == []  # the probe file is gone


def test_doctor_table_names_each_part(tmp_path, capsys):
    rc, out, _ = run_cli(["doctor", "--dir", str(tmp_path)], capsys)
    assert rc == 0
    for label in ("torch ", "megatron-core ", "engines:", "  posix    available", "checksum ",
                  "offload roots:", f"  {tmp_path}: ", "pinned memory      ulimit -l "):
        assert label in out, label


def test_doctor_flags_a_root_in_ram(capsys):
    from ssdtrain_megatron.io.where import filesystem_of

    if not os.path.isdir("/dev/shm") or filesystem_of("/dev/shm")[0] != "tmpfs":
        pytest.skip("no tmpfs at /dev/shm")
    # /dev/shm itself: a missing root is reported "missing", before what it is on
    rc, out, _ = run_cli(["doctor", "--dir", "/dev/shm"], capsys)
    assert "in RAM (tmpfs), not on an SSD" in out


# -- Ctrl-C -----------------------------------------------------------------------------------


def test_ctrl_c_says_how_many_offload_files_it_removed(tmp_path):
    """A real `ssdtrain demo` process, interrupted with SIGINT while its offload files exist."""
    root = tmp_path / "demo"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("SSDTRAIN_DEBUG", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "ssdtrain_megatron.tools.cli", "demo", "--dir", str(root), "--steps", "500",
         "--num-layers", "2", "--hidden-size", "64", "--seq-length", "64", "--micro-batch-size", "2",
         "--num-microbatches", "2", "--min-tensor-bytes", "4KiB"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            ranks = [d for d in root.iterdir() if d.name.startswith("ssdtrain.")] if root.is_dir() else []
            if ranks and any(f.name == "slab.bin" for d in ranks for f in d.iterdir()):
                break
            if proc.poll() is not None:
                pytest.fail(f"demo ended early: {proc.communicate()}")
            time.sleep(0.05)
        else:
            pytest.fail("no offload files appeared")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith("ssdtrain demo: interrupted; removed "), err
    n = int(last.split("removed ")[1].split()[0])
    assert n >= 1 and last.endswith(f"offload file{'s' if n != 1 else ''} under {root}"), last
    assert [p.name for p in root.iterdir() if p.name.startswith("ssdtrain.")] == []


# -- clean ------------------------------------------------------------------------------------


def _dead_rank_dir(root, job):
    """A rank directory whose owner (a process that has exited) left it behind: its record names
    this boot and a lock that no one holds any more."""
    from ssdtrain_megatron.io.layout import Identity, rank_dir_name
    from ssdtrain_megatron.io.owner import boot_id

    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                           text=True, check=True)
    pid = int(child.stdout)
    host = Identity.detect("x").hostname
    d = os.path.join(root, rank_dir_name(job, host, 0, pid))
    os.makedirs(d, mode=0o700)
    with open(os.path.join(d, "owner.json"), "w") as fh:
        json.dump({"pid": pid, "hostname": host, "job": job, "rank": 0, "boot_id": boot_id(), "lock": "flock"}, fh)
    with open(os.path.join(d, "slab.bin"), "wb") as fh:
        fh.write(b"x" * 8192)
    return d


def test_clean_expands_templates_like_the_config_does(tmp_path, capsys):
    """`ssdtrain clean /mnt/nvme0/ssdtrain/{job}` (the dirs entry as written) cleans every job."""
    a = _dead_rank_dir(tmp_path / "nvme0" / "job1", "job1")
    b = _dead_rank_dir(tmp_path / "nvme0" / "job2", "job2")
    rc, out, err = run_cli(["clean", str(tmp_path / "nvme0" / "{job}")], capsys)
    assert rc == 0, err
    removed = [line.split()[1] for line in out.splitlines() if line.startswith("removed ")]
    # The two rank directories, then the job folders the template's {job} names, left empty.
    assert sorted(removed) == sorted([a, b, str(tmp_path / "nvme0" / "job1"), str(tmp_path / "nvme0" / "job2")])
    assert not os.path.exists(a) and not os.path.exists(b)
    assert os.listdir(tmp_path / "nvme0") == []
    assert out.splitlines()[-1].startswith("2 stale directories, freed ")


def test_clean_says_when_a_template_matches_nothing(tmp_path, capsys):
    rc, out, err = run_cli(["clean", str(tmp_path / "{job}")], capsys)
    assert rc == 0
    assert err == f"ssdtrain clean: {tmp_path / '{job}'}: no directory matches\n"


@pytest.mark.parametrize("deepspeed,megatron_core,says", [
    ("0.19.8", "0.19.2", ["needs DeepSpeed 0.19.0"]),
    ("0.19.0", "0.15.3", ["it will refuse this one"]),
])
def test_doctor_names_the_releases_megatron_needs(tmp_path, capsys, monkeypatch, deepspeed, megatron_core, says):
    from ssdtrain_megatron.tools import doctor

    real = doctor.packages_report
    monkeypatch.setattr(doctor, "packages_report",
                        lambda: {**real(), "deepspeed": deepspeed, "megatron-core": megatron_core})
    rc, out, _ = run_cli(["doctor", "--dir", str(tmp_path)], capsys)
    assert rc == 0
    for text in says:
        assert text in out
    ds = next(line for line in out.splitlines() if line.startswith("deepspeed "))
    assert ("needs DeepSpeed 0.19.0" in ds) == (deepspeed != "0.19.0")
    mc = next(line for line in out.splitlines() if line.startswith("megatron-core "))
    assert ("refuse" in mc) == (megatron_core == "0.15.3")
