"""ssdtrain_megatron.megatron.deepspeed on real DeepSpeed (CPU accelerator, gloo, real processes).

Each run trains every phase in the same two processes: plain, with install() (offload to two
roots), and for the pipeline plain again after uninstall(). Offloaded training must be bitwise
identical to plain training (losses, gradients of every step, final parameters), every rank
must offload in every step, every backward must be announced before it runs, nothing may
be left on disk, and (writes settled before each backward) a pipeline rank wastes no byte it
writes from the second step on: what DeepSpeed's pipeline engine holds until backward
(``pipe_buffers``: labels, a partitioned stage input) passes through as held.

What cannot run on the CPU accelerator (each has a CUDA test below, skipped here):

* ``cpu_checkpointing`` without ``partition_activations``. On CUDA, DeepSpeed sends those
  checkpoint inputs to host memory through its asynchronous ``_ActivationOffloadEngine``, which
  it uses only on non-synchronized accelerators. The CPU accelerator is synchronized, so DeepSpeed
  takes its blocking path instead, and that path loses the inputs on a CPU device: the host copy
  ``copy_to_device(args, cpu)`` *is* the input, which ``get_cpu_activations_for_backward`` then
  empties (``arg.data = torch.empty([])``) before saving it as ``saved_data``, so the recompute
  receives a 0-dim tensor. This happens without ssdtrain as well (plain DeepSpeed 0.19.8 fails the
  same way). ``partition_activations`` with ``cpu_checkpointing`` does run on CPU (the partition is
  a fresh copy) and is tested here.
* Offloading from accelerator memory (CUDA events, copies back to the device) with DeepSpeed's
  engines; the pipeline over NCCL.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import types

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

pytest.importorskip("deepspeed")

import deepspeed_harness as harness  # noqa: E402
from bitwise import bitwise_equal  # noqa: E402
from deepspeed_harness import Phase, Spec  # noqa: E402

from ssdtrain_megatron import OffloadConfig  # noqa: E402
from ssdtrain_megatron.config import ConfigError  # noqa: E402
from ssdtrain_megatron.megatron import deepspeed as integration  # noqa: E402
from ssdtrain_megatron.megatron.ds_pipeline import BACKWARD, FORWARD, SchedulePlan  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

OFFLOAD = dict(dirs=["{root}/a", "{root}/b"], policy="offload", min_tensor_bytes=0)

PIPELINE = Spec(engine="pipeline", num_layers=6, phases=[
    Phase("plain"), Phase("offload", offload=OFFLOAD),
    Phase("plain_checkpoint", checkpoint=1),
    Phase("offload_checkpoint", offload=OFFLOAD, checkpoint=1),
    # A loss that saves its labels (cross entropy's target), and every layer written
    # (keep_last_layers=0): the last stage saves the labels pipe_buffers holds until backward.
    Phase("plain_ce", loss="cross_entropy"),
    Phase("offload_ce", offload={**OFFLOAD, "keep_last_layers": 0}, loss="cross_entropy"),
    Phase("after_uninstall"),
])
PIPELINE_PAIRS = [("plain", "offload"), ("plain_checkpoint", "offload_checkpoint"),
                  ("plain_ce", "offload_ce"), ("plain", "after_uninstall")]
# Every offloaded pipeline run: (spec name, phase). The harness lets queued writes finish before
# each backward (Phase.settle_writes), so what is written and read does not depend on IO speed.
PIPELINE_OFFLOADS = [("pipeline", "offload"), ("pipeline", "offload_checkpoint"),
                     ("pipeline", "offload_ce"), ("dualpipev", "offload")]
PIPELINE_LAYERS = [[0, 1, 2], [3, 4, 5]]  # per stage: PipelineModule's global layer indices

DUALPIPEV = Spec(engine="dualpipev", num_layers=8, phases=[Phase("plain"),
                                                           Phase("offload", offload=OFFLOAD)])

# Non-pipelined DeepSpeedEngine, 6 layers numbered 1..6 (layer_number), checkpoints of 2
# layers: their inputs belong to layers 1, 3 and 5. Both ranks form one tensor-parallel group
# for deepspeed.checkpointing (partitioned checkpoint inputs are gathered across it).
CHECKPOINT_MODES = {
    "checkpoint": {},
    "partition": dict(partition_activations=True),
    "partition_cpu": dict(partition_activations=True, cpu_checkpointing=True),
    "contiguous": dict(partition_activations=True, contiguous=True),
}
ENGINE = Spec(engine="engine", num_layers=6, phases=[
    Phase("plain"), Phase("offload", offload=OFFLOAD),
    Phase("offload_no_layer_classes", offload=OFFLOAD, layer_classes=[]),
    *[p for mode, kw in CHECKPOINT_MODES.items()
      for p in (Phase(f"plain_{mode}", checkpoint=2, **kw),
                Phase(f"offload_{mode}", offload=OFFLOAD, checkpoint=2, **kw))],
])
INPUT_BYTES = 2 * 16 * 32 * 4  # one micro-batch's hidden states: [2, 16, 32] float32


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            spec = {"pipeline": PIPELINE, "dualpipev": DUALPIPEV, "engine": ENGINE}[name]
            workdir = str(tmp_path_factory.mktemp(name))
            cache[name] = (harness.run(spec, workdir), workdir)
        return cache[name][0]

    get.workdir = lambda name: cache[name][1]
    return get


def _layer_rows(step):
    return {row["layer"]: row for row in step["layers"]}


def _assert_clean(info):
    for s in info["steps"]:
        assert s["bytes_on_disk"] == 0 and s["fallbacks"] == 0, s
    for files in info["files_after_step"]:
        # The owner marker and an emptied, sparse slab may stay until close; no activation data.
        assert all(size <= 4096 or allocated == 0 for _, size, allocated in files), files
    assert info["files_after_close"] == [] and info["dirs_after_close"] == []


# -- PipelineEngine, PP=2 -----------------------------------------------------------------------


@pytest.mark.parametrize("plain,other", PIPELINE_PAIRS)
def test_pipeline_training_is_bitwise_equal_with_offload_and_after_uninstall(plain, other, runs):
    for r in runs("pipeline"):
        assert harness.differences(r["phases"][plain], r["phases"][other]) == [], (r["rank"], other)
        assert len(r["phases"][plain]["grads"]) == PIPELINE.steps
        if other.startswith("offload"):  # equality alone could come from tensors that never left
            assert sum(s["bytes_read"] for s in r["phases"][other]["offload"]["steps"]) > 0, r["rank"]


@pytest.mark.parametrize("phase", ["offload", "offload_checkpoint"])
def test_pipeline_every_stage_offloads_every_step_in_its_own_layers(phase, runs):
    for r in runs("pipeline"):
        info = r["phases"][phase]["offload"]
        assert len(info["steps"]) == PIPELINE.steps
        for s in info["steps"]:
            assert s["bytes_offloaded"] > 0 and s["tensors_offloaded"] > 0, (r["rank"], s)
            layers = sorted(int(k) for k in _layer_rows(s) if k != "None")
            assert layers == PIPELINE_LAYERS[r["rank"]]
        assert info["patched_classes"] == ["ParallelTransformerLayer"]  # matched by name
        _assert_clean(info)


@pytest.mark.parametrize("name,phase", PIPELINE_OFFLOADS)
def test_pipeline_written_bytes_earn_their_keep(name, phase, runs):
    """From the second step on, at most 5% of the bytes each rank writes are wasted (written,
    then not read back: forwarded from memory or released unread), and bytes are read back.
    DeepSpeed clones a received stage input before the forward, so the buffers it holds
    until backward are saved only where a loss saves its labels (offload_ce, next test).
    Measured (settled writes): 0 bytes wasted in every phase. Broken variant: make
    EngineHooks._register_pipe_buffers return at once (ds_pipeline.py): offload_ce's
    last stage then writes its labels and forwards them, 1024 bytes a step, and the exact
    check below fails ("assert [1024, 1024] == [0, 0]"); with real IO timing
    (settle_writes=False) a rank may waste what was still being written (seen: 7.7% on
    offload_checkpoint's last stage)."""
    for r in runs(name):
        steps = r["phases"][phase]["offload"]["steps"]
        for s in steps:
            assert s["bytes_wasted"] == s["bytes_offloaded"] - s["bytes_read"], (r["rank"], s)
        later = steps[1:]
        written = sum(s["bytes_offloaded"] for s in later)
        wasted = sum(s["bytes_wasted"] for s in later)
        assert written > 0 and sum(s["bytes_read"] for s in later) > 0, (r["rank"], later)
        assert wasted <= 0.05 * written, (r["rank"], wasted, written)
        # What DeepSpeed holds is known (pipe_buffers): nothing it holds is written.
        assert [s["bytes_wasted"] for s in later] == [0] * len(later), r["rank"]


def test_pipeline_labels_a_loss_saves_pass_through_as_held(runs):
    """The last stage's cross entropy saves its labels, which pipe_buffers holds until that
    micro-batch's backward: registered as held, one per micro-batch, never written. The first
    stage's saved tensors are not the buffers (DeepSpeed clones its inputs): none held.
    Broken variant: make EngineHooks._register_pipe_buffers return at once
    ("assert [0, 0, 0] == [4, 4, 4]" on rank 1)."""
    for r in runs("pipeline"):
        steps = r["phases"]["offload_ce"]["offload"]["steps"]
        expected = PIPELINE.gas if r["rank"] == 1 else 0
        assert [s["tensors_held_by_schedule"] for s in steps] == [expected] * PIPELINE.steps


def test_pipeline_with_partitioned_stage_inputs_writes_nothing_it_holds(tmp_path):
    """PP=2 x "model"=2 (4 processes): DeepSpeed partitions what a stage sends and rebuilds the
    received input with ``full()``, a leaf that needs its gradient, which pipe_buffers keeps
    until backward and the first layer saves as is (no clone). It passes through (as a
    parameter-like leaf, and registered as held besides): bitwise equal, bytes read back, no
    byte wasted from the second step on. Broken variant: drop the leaf test in
    identity.offloadable_storage and make EngineHooks._register_pipe_buffers return at once
    (ds_pipeline.py): the last stage writes the rebuilt input and forwards it ("assert
    [16384, 16384] == [0, 0]"); either one alone keeps it in memory."""
    spec = Spec(engine="pipeline", world_size=4, model_parallel=2, num_layers=6,
                phases=[Phase("plain"), Phase("offload", offload=OFFLOAD)])
    for r in harness.run(spec, str(tmp_path)):
        assert harness.differences(r["phases"]["plain"], r["phases"]["offload"]) == [], r["rank"]
        steps = r["phases"]["offload"]["offload"]["steps"]
        assert all(s["bytes_read"] > 0 for s in steps), r["rank"]
        assert [s["bytes_wasted"] for s in steps[1:]] == [0] * (spec.steps - 1), r["rank"]
        _assert_clean(r["phases"]["offload"]["offload"])


def test_pipeline_checkpoint_inputs_are_offloaded_and_named_by_their_layer(runs):
    for r in runs("pipeline"):
        info = r["phases"]["offload_checkpoint"]["offload"]
        # activation_checkpoint_interval=1: one checkpoint per layer and micro-batch.
        assert info["checkpoints_routed"] == 3 * PIPELINE.gas * PIPELINE.steps
        rows = _layer_rows(info["steps"][0])
        first, middle, _ = PIPELINE_LAYERS[r["rank"]]
        # Each checkpoint saves just its input (the layers inside run under no_grad).
        assert rows[str(first)]["bytes"] == rows[str(middle)]["bytes"] == PIPELINE.gas * INPUT_BYTES
        # Offloaded: the writes that completed before backward released their input (on a
        # loaded machine, a write not started by then is cancelled), over all steps.
        written = [_layer_rows(s)[str(middle)]["bytes_offloaded"] for s in info["steps"]]
        assert all(w % INPUT_BYTES == 0 and w <= PIPELINE.gas * INPUT_BYTES for w in written)
        assert sum(written) > 0, written


def test_pipeline_announces_every_backward_before_it_runs(runs):
    for r in runs("pipeline"):
        info = r["phases"]["offload"]["offload"]
        assert info["steps_planned"] == PIPELINE.steps
        assert info["mispredictions"] == 0
        # 1F1B runs backwards in micro-batch order on every stage.
        assert info["hints"] == [list(range(PIPELINE.gas))] * PIPELINE.steps


def test_pipeline_eval_batch_is_not_recorded(runs):
    for r in runs("pipeline"):
        phase = r["phases"]["offload"]
        assert phase["offload"]["last_step"] == PIPELINE.steps - 1  # eval_batch ended no step
        assert bitwise_equal(phase["eval_loss"], r["phases"]["plain"]["eval_loss"])


def test_dualpipev_schedule_is_bitwise_equal_and_announces_both_phases(runs):
    for r in runs("dualpipev"):
        assert harness.differences(r["phases"]["plain"], r["phases"]["offload"]) == []
        info = r["phases"]["offload"]["offload"]
        assert sum(s["bytes_read"] for s in info["steps"]) > 0, r["rank"]  # not only forwarded
        assert info["mispredictions"] == 0
        for s, hints in zip(info["steps"], info["hints"]):
            assert s["bytes_offloaded"] > 0
            # Micro-batch keys are (phase, n): every micro-batch's backward in both phases.
            assert sorted(tuple(h) for h in hints) == [(p, n) for p in (0, 1) for n in range(4)]
        _assert_clean(info)


# -- DeepSpeedEngine without a pipeline, deepspeed.checkpointing ----------------------------------


@pytest.mark.parametrize("mode", ["", "_no_layer_classes", *[f"_{m}" for m in CHECKPOINT_MODES]])
def test_engine_training_is_bitwise_equal_with_offload(mode, runs):
    plain = "plain" + (mode if mode in [f"_{m}" for m in CHECKPOINT_MODES] else "")
    for r in runs("engine"):
        offloaded = r["phases"]["offload" + mode]
        assert harness.differences(r["phases"][plain], offloaded) == [], r["rank"]
        info = offloaded["offload"]
        assert all(s["bytes_offloaded"] > 0 for s in info["steps"]), info["steps"]
        assert sum(s["bytes_read"] for s in info["steps"]) > 0, r["rank"]  # not only forwarded
        assert len(info["steps"]) == ENGINE.steps  # one offloader step per optimizer step
        _assert_clean(info)


@pytest.mark.parametrize("mode,routed_bytes", [
    ("checkpoint", INPUT_BYTES),          # the whole input
    ("partition", INPUT_BYTES // 2),      # this rank's half (tensor-parallel group of 2)
    ("partition_cpu", INPUT_BYTES // 2),  # the host copy of the half (host = device on CPU)
    ("contiguous", 0),                    # DeepSpeed's preallocated buffers: left alone
])
def test_engine_checkpoint_inputs_are_offloaded_as_deepspeed_keeps_them(mode, routed_bytes, runs):
    checkpoints = ENGINE.num_layers // 2 * ENGINE.gas * ENGINE.steps
    for r in runs("engine"):
        info = r["phases"][f"offload_{mode}"]["offload"]
        assert info["checkpoints_routed"] == (checkpoints if routed_bytes else 0)
        for s in info["steps"]:
            rows = _layer_rows(s)
            assert sorted(k for k in rows if k != "None") == ["1", "3", "5"]  # first layer of each
            assert rows["1"]["bytes"] == ENGINE.gas * routed_bytes
            # Written unless backward released the input before an IO thread started its write
            # (a queued write of a released tensor is cancelled): on a loaded machine, some are.
            assert rows["1"]["bytes_offloaded"] <= rows["1"]["bytes"]
            assert rows["5"]["bytes_offloaded"] == 0  # the last layer: kept for its backward
        if routed_bytes:
            assert sum(_layer_rows(s)["1"]["bytes_offloaded"] for s in info["steps"]) > 0
    if mode == "contiguous":
        with open(os.path.join(runs.workdir("engine"), "rank0.log")) as f:
            assert "contiguous_memory_optimization" in f.read()


def test_engine_layer_scopes_come_from_the_named_classes(runs):
    for r in runs("engine"):
        named = r["phases"]["offload"]["offload"]
        rows = _layer_rows(named["steps"][0])
        assert sorted(k for k in rows if k != "None") == [str(i) for i in range(1, 7)]
        assert named["patched_classes"] == ["ParallelTransformerLayer"]
        none = r["phases"]["offload_no_layer_classes"]["offload"]
        assert none["patched_classes"] == []
        assert list(_layer_rows(none["steps"][0])) == ["None"]


# -- install() / uninstall() in this process ------------------------------------------------------


def _patch_points():
    from deepspeed.runtime.activation_checkpointing import checkpointing
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine
    from deepspeed.runtime.pipe.engine import PipelineEngine

    return [(DeepSpeedEngine, "forward"), (DeepSpeedEngine, "backward"), (DeepSpeedEngine, "step"),
            (PipelineEngine, "train_batch"), (PipelineEngine, "_exec_schedule"),
            (PipelineEngine, "_INSTRUCTION_MAP"), (DualPipeVEngine, "_INSTRUCTION_MAP"),
            (checkpointing, "CheckpointFunction")]


class _Layer(torch.nn.Module):
    def forward(self, x):
        return x * 2


class _NamedLayer(harness.ParallelTransformerLayer):
    """A subclass: the name matches through the MRO, and its base's forward is patched."""


def test_uninstall_restores_every_patched_attribute_exactly(tmp_path):
    import deepspeed

    points = _patch_points()
    before = [vars(owner)[name] for owner, name in points]
    layer_before = vars(_Layer)["forward"], vars(harness.ParallelTransformerLayer)["forward"]
    user = types.ModuleType("user_script")  # imported CheckpointFunction by name before install()
    user.CheckpointFunction = deepspeed.checkpointing.CheckpointFunction
    sys.modules[user.__name__] = user
    try:
        offloader = integration.install(OffloadConfig(dirs=[str(tmp_path)], min_tensor_bytes=0),
                                        layer_classes=[_Layer, "ParallelTransformerLayer"])
        try:
            during = [vars(owner)[name] for owner, name in points]
            assert all(a is not b for a, b in zip(before, during))
            assert user.CheckpointFunction is deepspeed.checkpointing.CheckpointFunction
            assert issubclass(deepspeed.checkpointing.CheckpointFunction, before[-1])
            assert vars(_Layer)["forward"] is not layer_before[0]  # a class object: at once
            inst = integration.installed()
            assert inst.offloader is offloader
            inst.scopes.discover(torch.nn.Sequential(_NamedLayer(8, 2, 0.0)))  # a name: when seen
            assert vars(harness.ParallelTransformerLayer)["forward"] is not layer_before[1]
            assert "forward" not in vars(_NamedLayer)
        finally:
            integration.uninstall()
        assert all(vars(owner)[name] is b for (owner, name), b in zip(points, before))
        after = vars(_Layer)["forward"], vars(harness.ParallelTransformerLayer)["forward"]
        assert after == layer_before
        assert user.CheckpointFunction is before[-1]
        assert integration.installed() is None
        assert os.listdir(tmp_path) == []  # uninstall() closed the offloader
        integration.uninstall()  # a second uninstall is a no-op
    finally:
        del sys.modules[user.__name__]


def test_a_pipeline_engine_subclass_built_after_install_is_not_wrapped_twice(tmp_path):
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.pipe.schedule import ForwardPass

    original = PipelineEngine._INSTRUCTION_MAP[ForwardPass]
    integration.install(OffloadConfig(dirs=[str(tmp_path)]))
    try:
        class LateEngine(PipelineEngine):
            _INSTRUCTION_MAP = dict(PipelineEngine._INSTRUCTION_MAP)  # copies the wrapped entries

        wrapped = LateEngine._INSTRUCTION_MAP[ForwardPass]
        integration.installed().patch_instruction_map(LateEngine)  # what _exec_schedule does
        assert LateEngine._INSTRUCTION_MAP[ForwardPass] is wrapped
    finally:
        integration.uninstall()
    assert PipelineEngine._INSTRUCTION_MAP[ForwardPass] is original
    assert wrapped.__wrapped__ is original  # and inactive now: it runs DeepSpeed's own


def test_install_twice_is_refused(tmp_path):
    integration.install(OffloadConfig(dirs=[str(tmp_path)]))
    try:
        with pytest.raises(RuntimeError, match="already"):
            integration.install(OffloadConfig(dirs=[str(tmp_path)]))
    finally:
        integration.uninstall()


def test_recompute_fallback_is_refused_with_deepspeeds_own_checkpointing_named(tmp_path):
    cfg = OffloadConfig(dirs=[str(tmp_path)], recompute_fallback=True, recompute_layers=[1])
    with pytest.raises(ConfigError, match="recompute_fallback.*activation_checkpoint_interval"):
        integration.install(cfg)
    assert integration.installed() is None


def test_a_missing_patch_point_fails_with_a_clear_message(tmp_path, monkeypatch):
    from deepspeed.runtime.pipe.engine import PipelineEngine

    monkeypatch.delattr(PipelineEngine, "_exec_schedule")
    with pytest.raises(integration.UnsupportedDeepSpeedVersion,
                       match="PipelineEngine._exec_schedule"):
        integration.install(OffloadConfig(dirs=[str(tmp_path)]))
    assert integration.installed() is None and os.listdir(tmp_path) == []


def test_the_launcher_installs_through_this_module():
    from ssdtrain_megatron.megatron.launch import MEGATRON_DEEPSPEED, _installer

    backend = _installer(MEGATRON_DEEPSPEED)
    assert backend is integration
    assert callable(backend.install) and callable(backend.uninstall) and backend.installed() is None


# -- the schedule plan, on DeepSpeed's own schedules ----------------------------------------------


def _simulate(schedule):
    """Run ``schedule`` through a SchedulePlan as the hooks do; returns (events, plan), events
    being ("F"/"B", key) for each compute instruction and ("hint", key) for each announcement."""
    from deepspeed.runtime.pipe import schedule as ds

    steps = [list(cmds) for cmds in schedule]
    plan = SchedulePlan(steps, ds.ForwardPass, ds.BackwardPass)
    events, hinted = [], set()

    def hint(key):
        if key is not None and key not in hinted:
            hinted.add(key)
            events.append(("hint", key))

    hint(plan.hint_at_start())
    for cmds in steps:
        for cmd in cmds:
            if isinstance(cmd, ds.ForwardPass):
                events.append((FORWARD, plan.forward_started(cmd.kwargs)))
            elif isinstance(cmd, ds.BackwardPass):
                events.append((BACKWARD, plan.backward_started(cmd.kwargs)))
            else:
                continue
            hint(plan.after_compute())
    return events, plan


@pytest.mark.parametrize("stages,micro_batches", [(2, 4), (4, 8), (3, 2)])
def test_train_schedule_keys_are_micro_batch_ids_and_each_backward_is_announced_first(
        stages, micro_batches):
    from deepspeed.runtime.pipe.schedule import TrainSchedule

    for stage in range(stages):
        events, plan = _simulate(TrainSchedule(micro_batches, stages, stage))
        assert plan.valid
        compute = [e for e in events if e[0] != "hint"]
        assert [k for kind, k in compute if kind == FORWARD] == list(range(micro_batches))
        assert [k for kind, k in compute if kind == BACKWARD] == list(range(micro_batches))
        for i, (kind, key) in enumerate(events):
            if kind == BACKWARD:
                # Announced right after the compute instruction before it (so the reads overlap
                # the communication in between), not earlier.
                assert events[i - 1] == ("hint", key)


def test_dualpipev_schedule_keys_carry_the_phase():
    from deepspeed.runtime.pipe.schedule import DualPipeVSchedule

    for stage in range(2):
        events, plan = _simulate(DualPipeVSchedule(4, 2, stage))
        assert plan.valid
        backwards = [k for kind, k in events if kind == BACKWARD]
        assert sorted(backwards) == [(p, n) for p in (0, 1) for n in range(4)]
        assert all(events[i - 1] == ("hint", k) for i, (kind, k) in enumerate(events)
                   if kind == BACKWARD)


def test_a_schedule_the_engine_does_not_follow_stops_the_hints():
    from deepspeed.runtime.pipe import schedule as ds

    plan = SchedulePlan(ds.TrainSchedule(2, 1, 0), ds.ForwardPass, ds.BackwardPass)
    plan.backward_started({"buffer_id": 0})  # a backward where the schedule has a forward
    assert not plan.valid and plan.after_compute() is None


# -- CUDA -----------------------------------------------------------------------------------------


_CPU_CHECKPOINTING_NEEDS_CUDA = (
    "DeepSpeed runs cpu_checkpointing (without partition_activations) through its asynchronous "
    "_ActivationOffloadEngine only on non-synchronized accelerators (CUDA), and its blocking path "
    "loses the checkpoint inputs on a CPU device (see the module docstring)")
_NCCL_PIPELINE_NEEDS_CUDA = "PipelineEngine over NCCL, offloading from GPU memory"


def _cuda_skip(devices: int, why: str):
    if not torch.cuda.is_available() or torch.cuda.device_count() < devices:
        return f"needs {devices} CUDA device{'s' if devices > 1 else ''}: {why}"
    return None


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_skip(1, _CPU_CHECKPOINTING_NEEDS_CUDA) is not None,
                    reason=str(_cuda_skip(1, _CPU_CHECKPOINTING_NEEDS_CUDA)))
def test_cuda_engine_with_cpu_checkpointing_and_partitions_is_bitwise_equal(tmp_path):
    modes = {"checkpoint": {}, "cpu": dict(cpu_checkpointing=True),
             "partition": dict(partition_activations=True),
             "partition_cpu": dict(partition_activations=True, cpu_checkpointing=True)}
    spec = Spec(engine="engine", world_size=1, device="cuda", phases=[
        p for mode, kw in modes.items()
        for p in (Phase(f"plain_{mode}", checkpoint=2, **kw),
                  Phase(f"offload_{mode}", offload=OFFLOAD, checkpoint=2, **kw))])
    (r,) = harness.run(spec, str(tmp_path))
    for mode in modes:
        plain, offloaded = r["phases"][f"plain_{mode}"], r["phases"][f"offload_{mode}"]
        assert harness.differences(plain, offloaded) == []
        info = r["phases"][f"offload_{mode}"]["offload"]
        assert all(s["bytes_offloaded"] > 0 for s in info["steps"])
        rows = _layer_rows(info["steps"][0])
        # cpu_checkpointing: the inputs already live in host memory (DeepSpeed's engine, or the
        # host copy of the partition); only what stays on the GPU is offloaded.
        expected = ENGINE.gas * INPUT_BYTES if mode in ("checkpoint", "partition") else 0
        assert rows["1"]["bytes_offloaded"] == expected, mode
        _assert_clean(info)


@pytest.mark.cuda
@pytest.mark.skipif(_cuda_skip(2, _NCCL_PIPELINE_NEEDS_CUDA) is not None,
                    reason=str(_cuda_skip(2, _NCCL_PIPELINE_NEEDS_CUDA)))
def test_cuda_pipeline_over_nccl_is_bitwise_equal(tmp_path):
    spec = dataclasses.replace(PIPELINE, device="cuda", phases=list(PIPELINE.phases))
    for r in harness.run(spec, str(tmp_path)):
        for plain, other in PIPELINE_PAIRS:
            assert harness.differences(r["phases"][plain], r["phases"][other]) == []
        for phase in ("offload", "offload_checkpoint"):
            info = r["phases"][phase]["offload"]
            assert all(s["bytes_offloaded"] > 0 for s in info["steps"])
            assert info["mispredictions"] == 0
            _assert_clean(info)
