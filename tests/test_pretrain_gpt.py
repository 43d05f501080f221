"""The real client: Megatron-LM's own pretrain_gpt.py, on CPU, with and without --ssd-offload.

Needs a Megatron-LM checkout named by ``MEGATRON_LM_DIR`` at a release tag of a supported
megatron-core (core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0) or at Megatron-LM
``main`` (megatron-core 0.20, tested at d98e8a64dd of 2026-08-22), run in an environment whose
megatron-core wheel is of the same minor version (``make venv-mcore-0.18``, then
``MEGATRON_LM_DIR=... .venv-mcore-0.18/bin/python -m pytest tests/test_pretrain_gpt.py``; the
wheel supplies the compiled dataset helpers and, 0.18+, triton); skipped without it. main has
no wheel of its minor: it runs in the venv of the newest wheel whose ``helpers.cpp`` is the
checkout's (``make test-megatron-main MEGATRON_LM_DIR=...``, the 0.19 venv). CI has no
checkout (it cannot fetch one), so these tests skip there.
Megatron-LM's training code also imports ``six`` and ``regex`` (``pip install six regex``). Each run trains 3 iterations of a tiny GPT
(``--mock-data``, gloo, ``--transformer-impl local``) under torchrun, with
``tests/megatron_lm_cpu_compat.py`` loaded into every worker through a generated
``sitecustomize.py``; a run takes about 20-30 s on 2 cores, the whole file about 4 minutes.

* the launcher (``python -m ssdtrain_megatron.launch pretrain_gpt.py ... --ssd-offload``)
  logs the same losses and grad norms as ``pretrain_gpt.py`` without the flag, every rank
  wrote bytes to its offload directory in every step, and nothing is left on disk: TP=1,
  TP=2, PP=2 (1F1B, 4 micro-batches), PP=2 interleaved (2 virtual stages), TP=2 with full
  recompute, and mixture of experts (4 experts, top-2, EP=2, alltoall). Not bf16: Megatron-LM's
  mixed-precision optimizers (``Float16OptimizerWithFloat16Params``, ``DistributedOptimizer``)
  accept only ``torch.cuda.*Tensor`` parameters, so ``--bf16`` cannot train on the CPU;
* resumed: 2 iterations saved, then the third from the checkpoint, with offload, logs what
  saving and resuming without offload logs (TP=2);
* a copy of pretrain_gpt.py patched by ``scripts/apply_patches.sh`` (the patch for that
  release) does the same (TP=1, TP=2, PP=2).
"""

from __future__ import annotations

import importlib.util
import json
from importlib import metadata
import os
import re
import shutil
import subprocess
import sys
from typing import Dict, List, Tuple

import pytest

from tests.tiny_gpt_flags import MEGATRON_LM_CPU, tiny_gpt

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

CHECKOUT = os.environ.get("MEGATRON_LM_DIR")

pytestmark = pytest.mark.skipif(
    not CHECKOUT, reason="MEGATRON_LM_DIR is not set: it names a Megatron-LM checkout at tag "
                         "core_v0.16.1, core_v0.17.1, core_v0.18.2 or core_v0.19.0, or at main "
                         "(megatron-core 0.20), whose pretrain_gpt.py these tests train on CPU")

ITERATIONS = 3
RUN_TIMEOUT_S = 420

# A tiny GPT that Megatron-LM trains on the CPU in seconds. --clip-grad 0: Megatron's gradient
# clipping asserts that gradients are CUDA tensors; clipping is not what these tests compare.
TINY_GPT = tiny_gpt(ITERATIONS) + MEGATRON_LM_CPU

_TP2 = ["--tensor-model-parallel-size", "2"]
LAYOUTS = {
    "tp1": (1, []),
    "tp2": (2, _TP2),
    "pp2": (2, ["--pipeline-model-parallel-size", "2"]),
    # Interleaved 1F1B: 4 layers, 2 stages of 2 virtual stages of one layer each.
    "pp2_vpp2": (2, ["--pipeline-model-parallel-size", "2",
                     "--num-layers-per-virtual-pipeline-stage", "1"]),
    "tp2_recompute_full": (2, _TP2 + ["--recompute-granularity", "full",
                                      "--recompute-method", "uniform",
                                      "--recompute-num-layers", "1"]),
    # megatron-core refuses MoE with TP > 1 without sequence parallel, which the local spec's
    # LayerNorm refuses: experts are parallel over the two data-parallel ranks.
    "moe_ep2": (2, ["--num-experts", "4", "--moe-router-topk", "2",
                    "--expert-model-parallel-size", "2", "--moe-token-dispatcher-type",
                    "alltoall", "--moe-router-load-balancing-type", "aux_loss",
                    "--moe-aux-loss-coeff", "1e-2"]),
}
PATCHED_LAYOUTS = ["tp1", "tp2", "pp2"]
# torch format: one file per rank; save-interval: Megatron asserts one with --save.
CHECKPOINTING = ["--ckpt-format", "torch", "--save-interval", "1000"]

_ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: (\S+) \|.*?grad norm: (\S+) \|")


def _checkout_version() -> str:
    info = os.path.join(CHECKOUT, "megatron", "core", "package_info.py")
    fields: Dict[str, str] = {}
    with open(info, encoding="utf-8") as fh:
        for line in fh:
            match = re.match(r"(MAJOR|MINOR|PATCH)\s*=\s*(\d+)", line)
            if match:
                fields[match.group(1)] = match.group(2)
    return ".".join(fields.get(k, "?") for k in ("MAJOR", "MINOR", "PATCH"))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> str:
    """A folder with the sitecustomize.py that loads the CPU shims into every torchrun worker."""
    if not os.path.isfile(os.path.join(CHECKOUT, "pretrain_gpt.py")):
        pytest.fail(f"MEGATRON_LM_DIR={CHECKOUT} has no pretrain_gpt.py")
    version = _checkout_version()
    from ssdtrain_megatron.megatron import compat

    if version[:4] not in compat.SUPPORTED_MEGATRON_CORE:
        pytest.skip(f"MEGATRON_LM_DIR is megatron-core {version}; these tests need a release "
                    f"tag of megatron-core {', '.join(compat.SUPPORTED_MEGATRON_CORE)}")
    try:
        wheel = metadata.version("megatron-core")
    except metadata.PackageNotFoundError:
        wheel = "none"
    if wheel[:4] != version[:4] and not _wheel_helpers_fit(version):
        pytest.skip(f"MEGATRON_LM_DIR is megatron-core {version} but this environment's wheel is "
                    f"{wheel}: run in a venv of the same minor version (make venv-mcore-"
                    f"{version[:4]}), or for main one whose wheel's dataset helpers are built "
                    f"from the checkout's helpers.cpp (make test-megatron-main)")
    missing = [m for m in ("six", "regex") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"Megatron-LM's training code imports {', '.join(missing)}: "
                    f"pip install {' '.join(missing)}")
    import megatron_lm_cpu_compat

    folder = str(tmp_path_factory.mktemp("site"))
    megatron_lm_cpu_compat.write_sitecustomize(folder, CHECKOUT)
    return folder


def _wheel_helpers_fit(version: str) -> bool:
    """For a release tested from a checkout (main, no wheel of its minor yet): whether the
    installed wheel's compiled dataset helpers (which the CPU shims use instead of building
    the checkout's) come from the same ``helpers.cpp`` as the checkout's."""
    from ssdtrain_megatron.megatron import compat

    if not compat.RELEASES[version[:4]].checkout:
        return False
    try:
        files = metadata.files("megatron-core") or []
    except metadata.PackageNotFoundError:
        return False
    wheel = next((f for f in files if str(f).endswith("core/datasets/helpers.cpp")), None)
    mine = os.path.join(CHECKOUT, "megatron", "core", "datasets", "helpers.cpp")
    if wheel is None or not os.path.isfile(mine):
        return False
    with open(wheel.locate(), "rb") as a, open(mine, "rb") as b:
        return a.read() == b.read()


def _torchrun(nproc: int, program: List[str], site: str, cwd: str) -> str:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([site] + [p for p in [env.get("PYTHONPATH")] if p])
    env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # Megatron asserts it for TP > 1
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), *program]
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-6000:]}")
    return proc.stdout


def _logged(output: str, first: int = 1) -> List[Tuple[int, str, str]]:
    """(iteration, lm loss, grad norm) as Megatron logged them, from iteration ``first``."""
    rows = [(int(i), loss, norm) for i, loss, norm in _ITERATION.findall(output)]
    assert [r[0] for r in rows] == list(range(first, ITERATIONS + 1)), output[-4000:]
    return rows


def _offload_flags(root: str, stats: str) -> List[str]:
    # min-tensor-bytes 0: the tiny model's activations are all below the 256 KiB default; the
    # temporary folder may be on the system disk, which the pre-flight refuses unasked.
    return ["--ssd-offload", "--ssd-offload-dir", root, "--ssd-offload-allow-system-disk",
            "--ssd-offload-stats-path", stats,
            "--ssd-offload-min-tensor-bytes", "0"]


def _check_offloaded(stats: str, root: str, nproc: int, iterations: int = ITERATIONS) -> None:
    with open(stats, encoding="utf-8") as fh:
        steps = [r for r in (json.loads(line) for line in fh if line.strip())
                 if "run" not in r]  # each run (and rank) starts with a header line
    assert len(steps) == nproc * iterations, steps
    assert all(s["bytes_offloaded"] > 0 and s["bytes_read"] > 0 for s in steps), \
        [(s["bytes_offloaded"], s["bytes_read"]) for s in steps]
    assert all(s["bytes_on_disk"] == 0 for s in steps)
    assert os.listdir(root) == [], "offload files were left behind"


_PLAIN: Dict[str, List[Tuple[int, str, str]]] = {}


def _plain(layout: str, site: str, tmp_path) -> List[Tuple[int, str, str]]:
    """Losses of pretrain_gpt.py without --ssd-offload (one run per layout per session)."""
    if layout not in _PLAIN:
        nproc, extra = LAYOUTS[layout]
        script = os.path.join(CHECKOUT, "pretrain_gpt.py")
        _PLAIN[layout] = _logged(_torchrun(nproc, [script, *TINY_GPT, *extra], site,
                                           str(tmp_path)))
    return _PLAIN[layout]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_launcher_offloads_without_changing_megatron_losses(layout, site, tmp_path):
    nproc, extra = LAYOUTS[layout]
    root, stats = tmp_path / "ssd", tmp_path / "stats.jsonl"
    root.mkdir()
    script = os.path.join(CHECKOUT, "pretrain_gpt.py")
    output = _torchrun(nproc, ["-m", "ssdtrain_megatron.launch", script, *TINY_GPT, *extra,
                               *_offload_flags(str(root), str(stats))], site, str(tmp_path))
    assert "ssdtrain: rank 0 offloads activations to" in output
    assert _logged(output) == _plain(layout, site, tmp_path)
    _check_offloaded(str(stats), str(root), nproc)


def _saved_then_resumed(folder, site: str, offload: bool) -> Tuple[list, list]:
    """TP=2: two iterations, saved (``--exit-interval``: Megatron saves and exits; the same
    ``--train-iters`` as the resumed run, which the checkpoint's lr schedule must match), then
    the third loaded from that checkpoint. The logged rows of both runs."""
    nproc, extra = LAYOUTS["tp2"]
    folder.mkdir()
    root, ckpt = folder / "ssd", folder / "ckpt"
    root.mkdir()
    script = os.path.join(CHECKOUT, "pretrain_gpt.py")
    program = ["-m", "ssdtrain_megatron.launch", script] if offload else [script]
    flags = _offload_flags(str(root), str(folder / "stats.jsonl")) if offload else []
    saved = _torchrun(nproc, [*program, *TINY_GPT, *extra, *CHECKPOINTING, "--exit-interval",
                              str(ITERATIONS - 1), "--save", str(ckpt), *flags], site,
                      str(folder))
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == \
        str(ITERATIONS - 1)
    resumed = _torchrun(nproc, [*program, *TINY_GPT, *extra, *CHECKPOINTING, "--load",
                                str(ckpt), *flags], site, str(folder))
    rows = [(int(i), loss, norm) for i, loss, norm in _ITERATION.findall(saved)]
    return rows, _logged(resumed, first=ITERATIONS)


def test_launcher_resumes_from_a_checkpoint_as_megatron_does_without_offload(site, tmp_path):
    """Saved after two iterations and resumed for the third, with offload in both runs: the
    same logged rows as saving and resuming without offload (Megatron's resumed third
    iteration is not the uninterrupted run's: it restores its RNG and data state its own way,
    offload or not), every step offloaded, nothing left."""
    plain = _saved_then_resumed(tmp_path / "plain", site, offload=False)
    offloaded = _saved_then_resumed(tmp_path / "offload", site, offload=True)
    assert [r[0] for r in plain[0]] == list(range(1, ITERATIONS))
    assert offloaded == plain
    _check_offloaded(str(tmp_path / "offload" / "stats.jsonl"), str(tmp_path / "offload" / "ssd"),
                     LAYOUTS["tp2"][0], ITERATIONS)


@pytest.mark.parametrize("layout", PATCHED_LAYOUTS)
def test_patched_checkout_offloads_without_changing_megatron_losses(layout, site, tmp_path):
    nproc, extra = LAYOUTS[layout]
    fork = tmp_path / "fork"  # the checkout itself stays untouched: patch a copy of the script
    fork.mkdir()
    shutil.copy(os.path.join(CHECKOUT, "pretrain_gpt.py"), fork)
    applied = subprocess.run(["bash", os.path.join(REPO, "scripts", "apply_patches.sh"),
                              str(fork)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    assert applied.returncode == 0, applied.stdout
    from test_patches import LM_PATCH_FOR

    assert f"applied {LM_PATCH_FOR[_checkout_version()[:4]]}" in applied.stdout
    root, stats = tmp_path / "ssd", tmp_path / "stats.jsonl"
    root.mkdir()
    # The copy imports gpt_builders, model_provider and megatron from the checkout, which the
    # sitecustomize puts on sys.path.
    output = _torchrun(nproc, [str(fork / "pretrain_gpt.py"), *TINY_GPT, *extra,
                               *_offload_flags(str(root), str(stats))], site, str(tmp_path))
    assert "ssdtrain: rank 0 offloads activations to" in output
    assert _logged(output) == _plain(layout, site, tmp_path)
    _check_offloaded(str(stats), str(root), nproc)
