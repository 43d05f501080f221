"""Megatron-DeepSpeed's own ``pretrain_gpt.py``, PP=2 through DeepSpeed's pipeline engine on the
CPU, with and without ``--ssd-offload`` (opt-in).

Needs a Megatron-DeepSpeed checkout named by ``MEGATRON_DEEPSPEED_DIR`` (deepspeedai/
Megatron-DeepSpeed master, 4efb479d) and a DeepSpeed that still has
``deepspeed.compression.compress``, which that checkout imports (0.19.0 has it; 0.19.8 removed
it): ``make venv-megatron-deepspeed``, then ``MEGATRON_DEEPSPEED_DIR=... make
test-megatron-deepspeed``. Skipped otherwise, with the reason.

The runs use DeepSpeed's own CPU accelerator (``DS_ACCELERATOR=cpu``, gloo; nothing of CUDA is
faked), ``LOCAL_SIZE`` set as DeepSpeed's CPU accelerator wants it under torchrun, micro-batch
size 1, and a small indexed dataset written with the checkout's own
``MMapIndexedDatasetBuilder``. The checkout builds its C++ dataset helpers (``make`` in
``megatron/data``, with pybind11) on the first run. A generated ``sitecustomize.py`` puts a
stand-in for ``megatron.model.vision.knn_monitor`` (vision only; it imports torchvision, which
cannot load beside the CPU torch build here) and wraps
``PipelineEngine.train_batch`` in every worker to record, per step, the exact loss it returned
(``float.hex``) and a SHA-256 of that rank's parameters after the step: Megatron's 7-digit log
line alone would hide a corruption of one part in 2**20.

Compared, offloaded against plain: those losses and hashes on both ranks, and Megatron's logged
``lm loss``; every rank must have written and read back bytes in every step and left nothing on
disk.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from typing import TYPE_CHECKING, Dict, List

import pytest

if TYPE_CHECKING:
    import torch

from tests.bitwise import bitwise_equal, tensor_leaves
from tests.tiny_gpt_flags import tiny_gpt

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CHECKOUT = os.environ.get("MEGATRON_DEEPSPEED_DIR")


def _skip_reason() -> str:
    if not CHECKOUT:
        return ("MEGATRON_DEEPSPEED_DIR is not set: it names a Megatron-DeepSpeed checkout whose "
                "pretrain_gpt.py these tests train on CPU")
    if importlib.util.find_spec("deepspeed") is None:
        return "needs DeepSpeed 0.19.0 (make venv-megatron-deepspeed)"
    if importlib.util.find_spec("deepspeed.compression.compress") is None:
        from importlib import metadata

        return (f"DeepSpeed {metadata.version('deepspeed')} has no deepspeed.compression."
                "compress, which Megatron-DeepSpeed imports: use DeepSpeed 0.19.0 "
                "(make venv-megatron-deepspeed)")
    if importlib.util.find_spec("pybind11") is None:
        return "Megatron-DeepSpeed builds its dataset helpers with pybind11: pip install pybind11"
    return ""


pytestmark = pytest.mark.skipif(bool(_skip_reason()), reason=_skip_reason() or "runs")

ITERATIONS = 3
NPROC = 2
RUN_TIMEOUT_S = 600

TINY_GPT = (["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "1"]
            + tiny_gpt(ITERATIONS, micro_batch=1, global_batch=4) + ["--data-impl", "mmap", "--deepspeed"])

DS_CONFIG = {
    "train_batch_size": 4, "train_micro_batch_size_per_gpu": 1, "steps_per_print": 1,
    "gradient_clipping": 0.0, "zero_optimization": {"stage": 0},
    "fp16": {"enabled": False}, "bf16": {"enabled": False}, "wall_clock_breakdown": False,
}

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|")

_SITECUSTOMIZE = '''\
# Written by tests/test_megatron_deepspeed_pretrain.py: records each pipeline step's exact loss
# and a hash of the rank's parameters after it, in every torchrun worker.
import os
import sys
import types

if "LOCAL_RANK" in os.environ:
    # megatron/training.py imports compute_feature_bank (vision pretraining only) from
    # megatron.model.vision.knn_monitor, which imports torchvision and PIL. PyPI's torchvision
    # cannot load beside the CPU torch 2.13.0 build these tests use, and the GPT path never
    # calls it: a stand-in module whose function says so.
    _knn = types.ModuleType("megatron.model.vision.knn_monitor")

    def compute_feature_bank(*args, **kwargs):
        raise RuntimeError("stand-in from tests/test_megatron_deepspeed_pretrain.py: vision "
                           "pretraining needs torchvision, which this test environment lacks")

    _knn.compute_feature_bank = compute_feature_bank
    sys.modules[_knn.__name__] = _knn

if "LOCAL_RANK" in os.environ and os.environ.get("SSDTRAIN_TEST_RECORD"):
    import hashlib
    import json

    import torch
    from deepspeed.runtime.pipe import engine as _pipe_engine

    _train_batch = _pipe_engine.PipelineEngine.train_batch

    def _parameter_hash(module):
        digest = hashlib.sha256()
        for name, p in sorted(module.named_parameters(), key=lambda item: item[0]):
            digest.update(name.encode())
            digest.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return digest.hexdigest()

    def train_batch(self, *args, **kwargs):
        loss = _train_batch(self, *args, **kwargs)
        entry = {"loss": float(loss).hex() if loss is not None else None,
                 "params": _parameter_hash(self.module)}
        path = os.path.join(os.environ["SSDTRAIN_TEST_RECORD"],
                            "rank%s.jsonl" % os.environ["RANK"])
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry) + "\\n")
        return loss

    _pipe_engine.PipelineEngine.train_batch = train_batch

if "LOCAL_RANK" in os.environ and os.environ.get("SSDTRAIN_TEST_PREEMPT_STEP"):
    # Preemption: SIGTERM to this worker as pipeline step N starts (its handlers run before
    # the step's first forward).
    import signal

    from deepspeed.runtime.pipe import engine as _preempted_engine

    _preempt_at = int(os.environ["SSDTRAIN_TEST_PREEMPT_STEP"])
    _steps_started = []
    _unpreempted = _preempted_engine.PipelineEngine.train_batch

    def preempted_train_batch(self, *args, **kwargs):
        _steps_started.append(1)
        if len(_steps_started) == _preempt_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return _unpreempted(self, *args, **kwargs)

    _preempted_engine.PipelineEngine.train_batch = preempted_train_batch
'''


def _write_dataset(prefix: str) -> None:
    """A few hundred short documents of random tokens, in the checkout's own mmap format."""
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {CHECKOUT!r})
        import numpy as np, torch
        from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder
        rng = np.random.default_rng(1234)
        builder = MMapIndexedDatasetBuilder({prefix + '.bin'!r}, dtype=np.uint16)
        for _ in range(400):
            builder.add_item(torch.from_numpy(rng.integers(1, 127, size=int(rng.integers(20, 80)))))
            builder.end_document()
        builder.finalize({prefix + '.idx'!r})
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Dict[str, str]:
    if not os.path.isfile(os.path.join(CHECKOUT, "pretrain_gpt.py")):
        pytest.fail(f"MEGATRON_DEEPSPEED_DIR={CHECKOUT} has no pretrain_gpt.py")
    folder = tmp_path_factory.mktemp("megatron-deepspeed")
    site = folder / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SITECUSTOMIZE)
    prefix = str(folder / "data" / "tokens_text_document")
    os.makedirs(os.path.dirname(prefix))
    _write_dataset(prefix)
    ds_config = folder / "ds_config.json"
    ds_config.write_text(json.dumps(DS_CONFIG))
    return {"site": str(site), "data": prefix, "ds_config": str(ds_config)}


class Run:
    def __init__(self, output: str, record: str) -> None:
        self.output = output
        self.logged = [(int(i), loss) for i, loss in _ITERATION.findall(output)]
        self.records: Dict[int, List[dict]] = {}
        for rank in range(NPROC):
            with open(os.path.join(record, f"rank{rank}.jsonl"), encoding="utf-8") as fh:
                self.records[rank] = [json.loads(line) for line in fh if line.strip()]


def _run(tmp_path, setup: Dict[str, str], name: str, extra: List[str], launcher: bool,
         preempt_step: int = 0) -> Run:
    record = tmp_path / f"record-{name}"
    record.mkdir()
    env = dict(os.environ)
    if preempt_step:
        env["SSDTRAIN_TEST_PREEMPT_STEP"] = str(preempt_step)
    env["PYTHONPATH"] = os.pathsep.join([setup["site"], REPO]
                                        + [p for p in [env.get("PYTHONPATH")] if p])
    # DeepSpeed's CPU accelerator, as a user without a GPU runs it; LOCAL_SIZE: what that
    # accelerator reads for the node's process count (torchrun does not set it).
    env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(NPROC), OMP_NUM_THREADS="1",
               SSDTRAIN_TEST_RECORD=str(record), CUDA_DEVICE_MAX_CONNECTIONS="1")
    # The checkout's `make -C megatron/data` runs `python3 -m pybind11`: this interpreter's.
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    script = os.path.join(CHECKOUT, "pretrain_gpt.py")
    program = (["-m", "ssdtrain_megatron.launch"] if launcher else []) + [
        script, *TINY_GPT, "--data-path", setup["data"], "--deepspeed_config",
        setup["ds_config"], *extra]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(NPROC), *program]
    proc = subprocess.run(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-8000:]}")
    return Run(proc.stdout, str(record))


@pytest.fixture(scope="module")
def runs(setup, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    root, stats = tmp / "ssd", tmp / "stats.jsonl"
    root.mkdir()
    plain = _run(tmp, setup, "plain", [], launcher=False)
    # allow-system-disk: the temporary folder may be on /, which the pre-flight refuses unasked.
    offload = _run(tmp, setup, "offload",
                   ["--ssd-offload", "--ssd-offload-dir", str(root), "--ssd-offload-allow-system-disk",
                    "--ssd-offload-stats-path",
                    str(stats), "--ssd-offload-min-tensor-bytes", "0"], launcher=True)
    with open(stats, encoding="utf-8") as fh:
        steps = [r for r in (json.loads(line) for line in fh if line.strip())
                 if "run" not in r]  # each run (and rank) starts with a header line
    return plain, offload, steps, str(root)


def test_losses_and_parameters_are_bitwise_equal_at_every_step(runs):
    plain, offload, _, _ = runs
    for rank in range(NPROC):
        assert len(plain.records[rank]) == ITERATIONS, plain.output[-4000:]
        assert len({r["params"] for r in plain.records[rank]}) == ITERATIONS  # weights moved
        assert offload.records[rank] == plain.records[rank], rank
    assert [r["loss"] for r in plain.records[NPROC - 1]] != [None] * ITERATIONS


def test_megatron_logs_the_same_lm_loss(runs):
    plain, offload, _, _ = runs
    assert [i for i, _ in plain.logged] == list(range(1, ITERATIONS + 1)), plain.output[-4000:]
    assert offload.logged == plain.logged


def test_every_rank_wrote_and_read_back_bytes_in_every_step(runs):
    _, _, steps, root = runs
    assert len(steps) == NPROC * ITERATIONS, steps
    assert all(s["bytes_offloaded"] > 0 and s["bytes_read"] > 0 for s in steps), \
        [(s["bytes_offloaded"], s["bytes_read"]) for s in steps]
    assert all(s["bytes_on_disk"] == 0 for s in steps)
    assert os.listdir(root) == [], "offload files were left behind"


PREEMPTED_AT = 2


def _checkpoint_tensors(save) -> Dict[str, "torch.Tensor"]:
    """Every tensor of every file of the checkpoint (DeepSpeed's layout), but RNG states."""
    import torch

    out: Dict[str, "torch.Tensor"] = {}
    for folder, _, files in os.walk(save):
        for name in sorted(f for f in files if f.endswith(".pt")):
            path = os.path.join(folder, name)
            tensor_leaves(os.path.relpath(path, save),
                          torch.load(path, map_location="cpu", weights_only=False), out,
                          skip=("rng",))
    return out


@pytest.fixture(scope="module")
def preempted(setup, tmp_path_factory):
    """The same SIGTERM at the start of step 2, with --exit-signal-handler, without and with
    offload (NOT RUN by the session that wrote it: no Megatron-DeepSpeed checkout was there)."""
    tmp = tmp_path_factory.mktemp("preempted")
    root = tmp / "ssd"
    root.mkdir()
    out = {}
    for name, launcher, offload in (("plain", False, []),
                                    ("offload", True, ["--ssd-offload", "--ssd-offload-dir",
                                                       str(root), "--ssd-offload-allow-system-disk",
                                                       "--ssd-offload-min-tensor-bytes",
                                                       "0"])):
        save = tmp / f"ckpt-{name}"
        run = _run(tmp, setup, f"preempted-{name}",
                   ["--exit-signal-handler", "--save", str(save), "--save-interval", "1000",
                    *offload], launcher=launcher, preempt_step=PREEMPTED_AT)
        out[name] = (run, save)
    return out, str(root)


def test_sigterm_lets_megatron_deepspeed_save_the_same_checkpoint_with_offload(preempted):
    """Megatron-DeepSpeed's --exit-signal-handler: the signal is passed on to its handler, the
    step finishes with offload working, the checkpoint of step 2 is saved (exit 0: _run fails
    otherwise), bitwise equal to the one saved without offload, and nothing is left on disk."""
    runs, root = preempted
    for name, (run, save) in runs.items():
        assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == \
            str(PREEMPTED_AT), (name, run.output[-4000:])
    (_, plain_save), (offload, offload_save) = runs["plain"], runs["offload"]
    assert "closed" not in offload.output, offload.output[-4000:]
    expected, got = _checkpoint_tensors(plain_save), _checkpoint_tensors(offload_save)
    assert sorted(got) == sorted(expected) and len(expected) > 0
    assert [k for k in expected if not bitwise_equal(got[k], expected[k])] == []
    assert os.listdir(root) == [], "offload files were left behind"
