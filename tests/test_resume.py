"""Restarting a Megatron job the way its users do: the same command line again, loading the
checkpoint the first run saved.

megatron-core 0.16.1 trains a tiny GPTModel on CPU with TP=2 in two real processes (gloo,
``tests/megatron_harness.py``). The first job trains 2 iterations with the offloader installed,
a per-rank stats file (``stats-{rank}.jsonl``) and ``{job}`` in the offload path, and saves a
checkpoint (weights, Adam state, RNG states, iteration; torch.save per rank, as the harness
keeps no megatron dist_checkpointing). A second job, in new processes, loads it twice: once
without offload, once with the same offload flags and the same stats path. The two resumed runs
must match bitwise (losses as integer views, gradients, final weights), match an uninterrupted
run of the same 4 iterations, read bytes back from the engine, and append to the stats files.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("megatron.core")

from megatron_harness import LayoutSpec, Phase, phase_differences, run_layout  # noqa: E402


def _bits(losses) -> list:
    return [[int(x.view(torch.int32)) for x in step] for step in losses]


def test_resuming_from_a_checkpoint_with_offload_gives_the_same_losses_and_appends_stats(tmp_path):
    stats = str(tmp_path / "out" / "stats-{rank}.jsonl")
    offload = {"dirs": ["{root}/{job}"], "job": "resume17", "stats_path": stats,
               "min_tensor_bytes": 0, "keep_last_layers": 0}
    ckpt = str(tmp_path / "ckpt")

    first_job = run_layout(LayoutSpec(tp=2, iterations=2, phases=[
        Phase("uninterrupted", iterations=4),
        Phase("first", offload=offload, save=ckpt),
    ]), str(tmp_path / "job1"))
    written = {}
    for rank in (0, 1):
        with open(stats.format(rank=rank)) as fh:
            written[rank] = fh.read().splitlines()
        assert len(written[rank]) == 3  # the run's header line, then two steps

    # The restart: new processes, the same flags, --load.
    second_job = run_layout(LayoutSpec(tp=2, iterations=2, phases=[
        Phase("resumed_plain", load=ckpt),
        Phase("resumed_offload", offload=offload, load=ckpt),
    ]), str(tmp_path / "job2"))

    for first, second in zip(first_job, second_job):
        plain, offloaded = second.phases["resumed_plain"], second.phases["resumed_offload"]
        assert phase_differences(plain, offloaded) == []
        assert _bits(offloaded.loss_tensors) == _bits(plain.loss_tensors)
        # ... and the resumed runs continue the uninterrupted one exactly.
        assert _bits(offloaded.loss_tensors) == _bits(first.phases["uninterrupted"].loss_tensors[2:])
        steps = offloaded.offload["steps"]
        assert [s["step"] for s in steps] == [0, 1]
        assert all(s["bytes_offloaded"] > 0 and s["bytes_read"] > 0 for s in steps), steps
        assert offloaded.offload["files_after_close"] == []
        with open(stats.format(rank=second.rank)) as fh:
            lines = fh.read().splitlines()
        assert lines[:3] == written[second.rank] and len(lines) == 6
        rows = [json.loads(s) for s in lines]
        assert ["run" in r for r in rows] == [True, False, False, True, False, False]
        assert [r["bytes_offloaded"] > 0 for r in rows if "run" not in r] == [True] * 4
    # Every offload folder is gone: the per-job {job} folder too, the root stays empty.
    for job in ("job1", "job2"):
        assert os.listdir(tmp_path / job / "offload_root") == []
