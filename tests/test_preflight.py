"""The pre-flight (megatron/preflight.py) and ``ssdtrain doctor --preflight``, in-process on real
folders: each problem the launcher must find before Megatron starts, in one line naming the
path and the fix. The launcher and the scripts running it under torchrun and Slurm:
tests/test_preflight_launch.py, tests/test_slurm_two_nodes.py."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from ssdtrain_megatron.io.layout import Identity
from ssdtrain_megatron.io.roots import on_system_disk
from ssdtrain_megatron.megatron import preflight
from ssdtrain_megatron.megatron.preflight import FlagError, check, launcher_problems, read_launch
from ssdtrain_megatron.plan.model import peak_disk_bytes
from ssdtrain_megatron.plan.shape import ModelShape
from tests.cli_helpers import run_cli

HOST = "node-a"


def _ranks(n: int, job: str = "77", node_rank: int = 0):
    return [Identity(node_rank * n + lr, lr, HOST, job) for lr in range(n)]


def _launch(*flags: str):
    return read_launch(["--num-layers", "2", "--ssd-offload", "--ssd-offload-job", "77", *flags])


def _allow(tmp_path) -> list:
    """--ssd-offload-allow-system-disk where tmp_path lies on / (as on this machine)."""
    return ["--ssd-offload-allow-system-disk"] if on_system_disk(str(tmp_path)) else []


def _whats(problems) -> list:
    return [(p.what, p.local_ranks) for p in problems]


def test_nothing_to_check_without_the_flag_and_bad_flags_say_so_in_one_line(tmp_path):
    assert read_launch(["--num-layers", "2", "--ssd-offload-io-threads", "2"]) is None
    with pytest.raises(FlagError) as err:
        read_launch(["--ssd-offload", "--ssd-offload-io-threads", "0"])
    assert str(err.value) == "argument --ssd-offload-io-threads: 0 is invalid: expected an integer >= 1"
    bad = tmp_path / "bad.yaml"
    bad.write_text("offload: {engine: nvme}\n")
    with pytest.raises(FlagError, match=r"^argument --ssd-offload-config: OffloadConfig.engine='nvme'"):
        read_launch(["--ssd-offload", "--ssd-offload-config", str(bad)])
    model = tmp_path / "model.yaml"
    model.write_text("model: {num_layers: 2}\noffload: {}\n")  # its model: section, invalid
    with pytest.raises(FlagError, match=rf"^argument --ssd-offload-config: {model}: model: missing key"):
        read_launch(["--ssd-offload", "--ssd-offload-config", str(model)])


def test_a_missing_root_names_the_root_the_template_and_the_fix_for_each_local_rank(tmp_path):
    """Broken variant (check() without the root checks): "assert [] == [...]"."""
    (tmp_path / "nvme0" / "ssdtrain").mkdir(parents=True)
    template = f"{tmp_path}/nvme{{local_rank}}/ssdtrain/{{job}}"
    problems = check(_launch("--ssd-offload-dir", template, *_allow(tmp_path)), _ranks(2))
    assert _whats(problems) == [(
        f"offload root {tmp_path}/nvme1/ssdtrain (dirs[0] {template!r}) does not exist: mount the "
        "drive or create it; we create only our job and rank folders below a root "
        "(--ssd-offload-create-dirs / create_dirs: true creates it anyway)", (1,))]
    # create_dirs: the offloader makes it, so it is not a problem (and nothing is made here).
    assert check(_launch("--ssd-offload-dir", template, "--ssd-offload-create-dirs",
                         *_allow(tmp_path)), _ranks(2)) == []
    assert not (tmp_path / "nvme1").exists()


def test_a_file_as_root_and_a_symlinked_job_folder_are_refused(tmp_path):
    (tmp_path / "root").write_text("a file")
    (problem,) = check(_launch("--ssd-offload-dir", f"{tmp_path}/root/{{job}}"), _ranks(1))
    assert problem.what == (f"offload root {tmp_path}/root (dirs[0] '{tmp_path}/root/{{job}}') is not "
                            "a directory: point --ssd-offload-dir (dirs) at a directory on the "
                            "drive, or move what is there out of the way")
    (tmp_path / "drive" / "elsewhere").mkdir(parents=True)
    os.symlink(tmp_path / "drive" / "elsewhere", tmp_path / "drive" / "77")  # where {job} goes
    (problem,) = check(_launch("--ssd-offload-dir", f"{tmp_path}/drive/{{job}}"), _ranks(1))
    assert "is a symlink where a job directory should be; refusing to follow it" in problem.what


def test_a_root_on_the_system_disk_is_refused_unless_allowed():
    root = tempfile.mkdtemp(prefix="ssdtrain-preflight-test-", dir="/var/tmp")
    try:
        if not on_system_disk(root):
            pytest.skip("/var/tmp is not on the filesystem of / here")
        (problem,) = check(_launch("--ssd-offload-dir", root), _ranks(1))
        assert problem.what.startswith(f"offload root {root} is on the filesystem of / (")
        assert problem.what.endswith("or allow it with --ssd-offload-allow-system-disk "
                                     "(allow_system_disk: true)")
        assert check(_launch("--ssd-offload-dir", root, "--ssd-offload-allow-system-disk"),
                     _ranks(1)) == []
        assert os.listdir(root) == []  # the writability probe is gone
    finally:
        shutil.rmtree(root)


def test_a_root_we_cannot_write_to_is_refused(tmp_path):
    """As root every mode bit is ignored: the check runs in a child as user nobody."""
    shared = tempfile.mkdtemp(prefix="ssdtrain-preflight-ro-", dir="/tmp")  # 0700 by mkdtemp
    os.chmod(shared, 0o755)
    launch = _launch("--ssd-offload-dir", shared, "--ssd-offload-allow-system-disk")
    try:
        if os.geteuid() != 0:
            os.chmod(shared, 0o555)
            found = check(launch, _ranks(1))
        else:
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: nobody, then the check; its result through the pipe
                try:
                    os.setgid(65534)
                    os.setuid(65534)
                    os.write(write, "\n".join(p.what for p in check(launch, _ranks(1))).encode())
                finally:
                    os._exit(0)
            os.close(write)
            with os.fdopen(read) as fh:
                found_text = fh.read()
            os.waitpid(pid, 0)
            found = [preflight.Problem(t) for t in found_text.splitlines()]
        assert [p.what for p in found] == [
            f"offload root {shared} is not writable by uid {65534 if os.geteuid() == 0 else os.getuid()} "
            "(Permission denied): give the training user a directory there (chown), mount the "
            "drive read-write, or point --ssd-offload-dir elsewhere"]
    finally:
        os.chmod(shared, 0o755)
        shutil.rmtree(shared)


def _shape_needing(fraction: float, free: int) -> tuple:
    """(a preset's model whose peak on disk is about ``fraction`` of ``free`` bytes, that peak)."""
    base = dict(num_layers=2, hidden=64, heads=4, ffn_hidden=256, seq_len=64, micro_batch=1)
    per_batch = peak_disk_bytes(ModelShape(**base), 0)
    batch = max(int(fraction * free) // per_batch, 1)
    return dict(base, micro_batch=batch), peak_disk_bytes(ModelShape(**dict(base, micro_batch=batch)), 0)


def test_free_space_is_held_against_every_local_rank_that_writes_to_the_drive(tmp_path):
    """One rank's peak fits the drive, two ranks' on the same drive do not: the node's sum
    counts. Broken variant (need = one rank's share, not the drive's sum): no problem for two
    ranks either: "ValueError: not enough values to unpack (expected 1, got 0)"."""
    from ssdtrain_megatron.io.layout import free_bytes

    shape, need = _shape_needing(0.75, free_bytes(str(tmp_path)))
    preset = tmp_path / "p.yaml"
    # engine posix, named: all of the peak goes to the drive (with the node's choice, a host
    # pool takes part of it: tests/test_engine_choice.py)
    preset.write_text(f"model: {shape}\noffload: {{keep_last_layers: 0, engine: posix}}\n".replace("'", ""))
    root = tmp_path / "ssd"
    root.mkdir()
    flags = ["--ssd-offload-config", str(preset), "--ssd-offload-dir", f"{root}/{{job}}",
             *_allow(tmp_path)]
    assert check(_launch(*flags), _ranks(1)) == []
    (problem,) = check(_launch(*flags), _ranks(2))
    assert problem.local_ranks == (0, 1)
    assert problem.what.startswith(f"the drive of {root} (")
    assert "2 local rank(s) will keep up to" in problem.what
    assert "p.yaml's model: " in problem.what and "SSDTRAIN_SKIP_PREFLIGHT=1" in problem.what
    # Megatron's own flag wins over the preset's micro-batch: a quarter of it fits again.
    quarter = ["--micro-batch-size", str(max(shape["micro_batch"] // 4, 1))]
    assert check(read_launch(quarter + ["--ssd-offload", *flags]), _ranks(2)) == []
    # The baseline writes nothing: no figure to hold against the drive.
    assert check(_launch(*flags, "--ssd-offload-policy", "keep"), _ranks(2)) == []
    assert need > 0


def test_an_engine_that_cannot_run_here_says_why(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("gds may run here")
    (problem,) = check(_launch("--ssd-offload-engine", "gds", "--ssd-offload-dir", str(tmp_path),
                               *_allow(tmp_path)), _ranks(2))
    assert problem.local_ranks == (0, 1)
    assert problem.what.startswith("engine 'gds' cannot run here: ")
    assert problem.what.endswith("choose another with --ssd-offload-engine (`ssdtrain doctor` "
                                 "lists the engines that run here)")
    # The memory engine writes no file: its roots are not looked at.
    assert check(_launch("--ssd-offload-engine", "memory", "--ssd-offload-dir", "/nonexistent"),
                 _ranks(2)) == []


def test_every_worker_stops_for_its_node_and_the_lowest_rank_concerned_names_the_problem(tmp_path):
    """Local rank 0's drive is there, local rank 1's is not: both stop (neither goes on into
    Megatron), only local rank 1 prints. Broken variant (each worker checks only its own
    roots): "assert ([], False) == ([], True)" for local rank 0."""
    import socket

    (tmp_path / "nvme0").mkdir()
    flags = ["--ssd-offload", "--ssd-offload-dir", f"{tmp_path}/nvme{{local_rank}}", *_allow(tmp_path)]
    rank0 = {"RANK": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    rank1 = {"RANK": "5", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert launcher_problems(flags, rank0) == ([], True)
    (lines, failed) = launcher_problems(flags, rank1)
    assert failed and len(lines) == 1
    assert lines[0].startswith(f"node {socket.gethostname()}, rank 5 (local rank 1): offload root "
                               f"{tmp_path}/nvme1 (dirs[0] '{tmp_path}/nvme{{local_rank}}') does not exist")
    # A problem of every rank (a flag) is said by local rank 0 alone.
    bad = ["--ssd-offload-chunk-bytes", "3"]
    assert launcher_problems(bad, rank1) == ([], True)
    (lines, _) = launcher_problems(bad, rank0)
    assert lines == [f"node {socket.gethostname()}, rank 4 (local rank 0): argument "
                     "--ssd-offload-chunk-bytes: 3 is invalid: expected an integer >= 4096"]
    assert launcher_problems(["--num-layers", "2"], rank1) == ([], False)


def test_doctor_preflight_prints_one_line_per_failing_node_and_nothing_when_it_passes(tmp_path, capsys):
    (tmp_path / "nvme0" / "ssdtrain").mkdir(parents=True)
    template = f"{tmp_path}/nvme{{local_rank}}/ssdtrain/{{job}}"
    rc, out, err = run_cli(["doctor", "--preflight", "--nproc-per-node", "3", "--", "--ssd-offload",
                            "--ssd-offload-dir", template, "--ssd-offload-job", "9",
                            *_allow(tmp_path)], capsys)
    import socket

    assert (rc, out) == (2, "")
    assert err.count("\n") == 1
    assert err.startswith(f"ssdtrain doctor: error: node {socket.gethostname()}, local rank 1: "
                          f"offload root {tmp_path}/nvme1/ssdtrain ")
    assert "(and 1 more on this node: local rank 2: offload root " in err
    (tmp_path / "nvme1" / "ssdtrain").mkdir(parents=True)
    (tmp_path / "nvme2" / "ssdtrain").mkdir(parents=True)
    assert run_cli(["doctor", "--preflight", "--nproc-per-node", "3", "--", "--ssd-offload",
                    "--ssd-offload-dir", template, *_allow(tmp_path)], capsys) == (0, "", "")
    # Without launcher arguments: the doctor's own --dir (and --config).
    rc, _, err = run_cli(["doctor", "--preflight", "--dir", str(tmp_path / "gone")], capsys)
    assert rc == 2 and f"offload root {tmp_path}/gone does not exist" in err
    rc, _, err = run_cli(["doctor", "--", "--ssd-offload"], capsys)
    assert rc == 2 and "add it" in err


def test_the_preflight_imports_no_megatron_even_when_it_passes(tmp_path):
    """A `megatron` package that refuses to be imported is first on the path; the launcher's
    pre-flight of a node that passes (and of one that fails) never touches it."""
    import subprocess
    import sys

    (tmp_path / "megatron").mkdir()
    (tmp_path / "megatron" / "__init__.py").write_text("raise ImportError('megatron was imported')\n")
    (tmp_path / "ssd").mkdir()
    code = (
        "import sys\n"
        "from ssdtrain_megatron.megatron.preflight import launcher_problems\n"
        f"ok = launcher_problems(['--ssd-offload', '--ssd-offload-dir', {str(tmp_path / 'ssd')!r},"
        " '--ssd-offload-allow-system-disk', '--ssd-offload-config', 'llama3-8b',"
        " '--micro-batch-size', '1', '--num-layers', '2'], {})\n"
        f"bad = launcher_problems(['--ssd-offload', '--ssd-offload-dir', {str(tmp_path / 'gone')!r}], {{}})\n"
        "print(ok[1], bad[1], 'megatron' in sys.modules)\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{root}"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True", "False"]
