"""The engine follows the node, where users meet it: the real launcher under torchrun (2 worker
processes, CPU), a preset that names no engine, and the real ``install()`` into megatron-core.

Megatron-LM's training package is a stand-in folder (its ``megatron/`` has no ``__init__.py``,
so ``megatron.core`` still comes from the installed wheel): ``parse_args`` and
``initialize_megatron`` shaped like Megatron-LM's, which the launcher's hooks wrap. Its
``pretrain_gpt.py`` logs at INFO (Megatron-LM's ``--logging-level 20``), then runs one step of a
small model through the installed offloader's scopes and prints, per rank, the engine it runs
and where the step's bytes went. With host memory to spare (this machine's MemAvailable) the
job runs tiered, its bytes in host memory; with host memory capped below one layer
(``SSDTRAIN_HOST_MEMORY_FREE``) it runs posix, its bytes on the drive, and each rank says why
in one line; ``--ssd-offload-engine posix`` is honoured with memory to spare.
The rule itself: tests/test_engine_choice.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from ssdtrain_megatron.io.roots import on_system_disk

pytest.importorskip("megatron.core")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 300

# cpu-tiny's model at micro-batch 1, and no engine, policy or pool.
MODEL = dict(num_layers=8, hidden=256, heads=4, ffn_hidden=1024, seq_len=256, micro_batch=1,
             vocab=512, dtype="fp32")
PRESET = """\
model: {num_layers: 8, hidden: 256, heads: 4, ffn_hidden: 1024, seq_len: 256, micro_batch: 1,
        vocab: 512, dtype: fp32}
parallel: {tp: 1, pp: 1}
offload: {dirs: ["%s/ssd/{job}"], io_threads: 1}
"""

STAND_IN = {
    "megatron/training/__init__.py": "",
    "megatron/training/global_vars.py": """\
_ARGS = None


def get_args():
    return _ARGS


def set_args(args):
    global _ARGS
    _ARGS = args
""",
    "megatron/training/arguments.py": """\
import argparse
import os


def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = argparse.ArgumentParser()
    parser.add_argument("--micro-batch-size", type=int)
    if extra_args_provider is not None:
        parser = extra_args_provider(parser)
    args = parser.parse_args()
    args.rank = int(os.environ["RANK"])
    return args
""",
    "megatron/training/initialize.py": """\
from megatron.training import arguments, global_vars


def initialize_megatron(extra_args_provider=None, args_defaults={}):
    # as Megatron-LM's: the module-level name, looked up at call time (the launcher wraps it)
    global_vars.set_args(arguments.parse_args(extra_args_provider))
""",
    "pretrain_gpt.py": """\
import json
import logging
import os

import torch

logging.basicConfig(level=logging.INFO, format="%(message)s")  # --logging-level 20
from megatron.training.initialize import initialize_megatron

initialize_megatron()
import ssdtrain_megatron.megatron as integration

off = integration.installed().offloader
torch.manual_seed(0)
layers = [torch.nn.Linear(256, 256) for _ in range(4)]
with off.microbatch(0):
    h = torch.randn(1024, 256)
    for i, layer in enumerate(layers):
        with off.layer(i):
            h = torch.relu(layer(h))
    loss = h.square().mean()
off.wait_writes()  # every write lands first: bytes offloaded whatever the machine's load
off.begin_backward(0)
loss.backward()
stats = off.end_step()
c = off.config
print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), "engine": c.engine,
                              "policy": c.policy, "host_memory_bytes": c.host_memory_bytes,
                              "engine_class": type(off.engine).__name__,
                              "offloaded": stats.bytes_offloaded, "tiers": stats.tier_bytes}),
      flush=True)
""",
}


@pytest.fixture
def job(tmp_path):
    mlm = tmp_path / "Megatron-LM"
    for rel, text in STAND_IN.items():
        (mlm / rel).parent.mkdir(parents=True, exist_ok=True)
        (mlm / rel).write_text(text)
    (tmp_path / "ssd").mkdir()
    (tmp_path / "tiny.yaml").write_text(PRESET % tmp_path)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SSDTRAIN", "TORCHELASTIC", "LOCAL_WORLD_SIZE"))}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return tmp_path, env


def _train(job, *flags, **env):
    tmp_path, base = job
    allow = ["--ssd-offload-allow-system-disk"] if on_system_disk(str(tmp_path)) else []
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         "-m", "ssdtrain_megatron.launch", str(tmp_path / "Megatron-LM" / "pretrain_gpt.py"),
         "--ssd-offload", "--ssd-offload-config", str(tmp_path / "tiny.yaml"), *allow, *flags],
        env=dict(base, **env), cwd=str(tmp_path), capture_output=True, text=True,
        timeout=TIMEOUT_S)
    assert out.returncode == 0, out.stderr[-4000:]
    results = sorted((json.loads(line[len("RESULT "):]) for line in out.stdout.splitlines()
                      if line.startswith("RESULT ")), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1], out.stdout[-2000:]
    lines = {int(m.group(1)): m.group(2) for m in
             re.finditer(r"^ssdtrain: rank (\d+): (engine .*)$", out.stderr, re.MULTILINE)}
    assert sorted(lines) == [0, 1], out.stderr[-4000:]
    assert list(os.walk(tmp_path / "ssd")) == [(str(tmp_path / "ssd"), [], [])]  # nothing left
    return results, lines


def _layer_bytes() -> int:
    """One layer's activations of the preset's model (the analytic model, plan/model.py)."""
    from ssdtrain_megatron.plan.model import ModelShape, SaveProfile, layer_activation_bytes

    return layer_activation_bytes(ModelShape.from_preset(MODEL, {"tp": 1, "pp": 1}), SaveProfile.paper())


def test_a_preset_without_an_engine_runs_tiered_where_host_memory_is_to_spare(job):
    """No budget: policy offload, the recompute fallback off (adaptive would keep everything).
    Broken variant (install_from_args back on config_from_args alone): engine 'posix' and
    'PosixEngine', the bytes on the drive."""
    from ssdtrain_megatron.megatron.host_memory import measure
    from ssdtrain_megatron.plan.engine_choice import free_per_rank

    layer = _layer_bytes()
    here = measure({"LOCAL_WORLD_SIZE": "2"})
    if here is None or free_per_rank(here.free_bytes, 2, 2 << 30) < 16 * layer:
        pytest.skip(f"no host memory to spare here ({here}): the rule chooses posix")
    results, lines = _train(job)
    for r in results:
        assert (r["engine"], r["engine_class"], r["policy"]) == ("tiered", "TieredEngine", "offload")
        assert r["offloaded"] > 0 and r["tiers"]["host"] == r["offloaded"] and r["tiers"]["ssd"] == 0
        # the pool is what the preset's plan puts in host memory (7 of 8 layers) and one layer more
        assert r["host_memory_bytes"] == 8 * layer
        assert re.fullmatch(rf"engine tiered: \S+ [kMGT]?B host memory free for 2 local "
                            rf"rank\(s\), {7 * layer / 1e6:.1f} MB per rank planned: a host "
                            rf"pool of {8 * layer / 1e6:.1f} MB of \S+ [kMGT]?B per rank; policy "
                            "offload, recompute fallback off", lines[r["rank"]]), lines[r["rank"]]


def test_with_host_memory_below_one_layer_it_runs_posix_and_says_why(job):
    """Broken variant (choose_engine ignoring what is free): tiered, with a pool of one layer.
    The pinned staging is set small: staging larger than the host memory per rank is refused
    (issue 66), and this CPU job pins none of it."""
    results, lines = _train(job, "--ssd-offload-pinned-staging-bytes", "1000",
                            SSDTRAIN_HOST_MEMORY_FREE="1MB")
    for r in results:
        assert (r["engine"], r["engine_class"]) == ("posix", "PosixEngine")
        assert r["offloaded"] > 0 and r["tiers"].get("host", 0) == 0 and r["tiers"]["ssd"] == r["offloaded"]
        assert lines[r["rank"]] == (
            "engine posix: 1.0 MB host memory free ($SSDTRAIN_HOST_MEMORY_FREE) for 2 local "
            f"rank(s), 374.0 kB per rank for offload, less than one layer's activations "
            f"({_layer_bytes() / 1e6:.1f} MB)")


def test_a_named_engine_is_honoured_with_host_memory_to_spare(job):
    results, lines = _train(job, "--ssd-offload-engine", "posix")
    for r in results:
        assert (r["engine"], r["engine_class"], r["policy"]) == ("posix", "PosixEngine", "offload")
        assert lines[r["rank"]] == "engine posix: named by --ssd-offload-engine (posix)"
