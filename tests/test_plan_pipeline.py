"""`ssdtrain plan` for a pipeline's first stage: the deferred last layers it writes, and a plan's
kept layers held for every micro-batch in flight (plan/model.py, tools/plan_cli.py)."""

from __future__ import annotations

from ssdtrain_megatron.plan import peak_activation_bytes
from tests.test_plan_model import AS2B, GPT, LAYER_BYTES, PRESET, SBH, plan_json


def test_the_offload_peak_holds_a_plans_kept_layers_per_micro_batch_in_flight():
    """A plan keeping 3 layers, of which the last is deferred: the two others stay for each of
    the 4 in-flight micro-batches, the last only for the one about to run backward."""
    shape = GPT.replace(pp=4)
    layer = 34 * SBH + 5 * AS2B
    assert peak_activation_bytes(shape, "offload", resident_bytes=3 * layer,
                                 deferred_bytes=layer) == 4 * 2 * layer + layer + layer


def test_with_a_pipeline_the_first_stage_writes_deferred_layers_and_keeps_a_plan_per_micro_batch(
        capsys, tmp_path):
    """Under 1F1B the first stage runs the next micro-batch's forward before a micro-batch's
    backward: the offloader then writes that micro-batch's deferred last layer (offloader.py
    ``microbatch``), so all micro-batches but the step's last write it; and layers a plan keeps
    for bandwidth stay for each of the pp micro-batches in flight, not for one.
    Broken variants: ``_first_stage_offloaded`` without the deferred term: 8 x L, not 15 x L;
    ``peak_activation_bytes`` counting the kept layers once: 3 x L + head, not 4 x L + head."""
    path = tmp_path / "pp2.yaml"
    path.write_text(PRESET.replace("pp: 1", "pp: 2"))  # 2 layers per stage
    fast = plan_json(capsys, str(path), "--ssd-gbps", "1000", "--num-microbatches", "8")
    assert [row["decision"] for row in fast["layers"]] == ["offload", "keep"]
    assert fast["deferred_bytes_per_micro_batch"] == LAYER_BYTES
    assert fast["offloaded_bytes_per_step"] == 8 * LAYER_BYTES + 7 * LAYER_BYTES
    slow = plan_json(capsys, str(path), "--ssd-gbps", "0.0001", "--num-microbatches", "8")
    assert [row["decision"] for row in slow["layers"]] == ["keep", "keep"]
    peak = slow["peak_activation_bytes"]
    head = peak["keep"] - 2 * 2 * LAYER_BYTES  # keep: 2 micro-batches x 2 layers, plus the head
    # layer 1 kept for both micro-batches in flight, layer 2 (deferred) for one, one in transit
    assert peak["offload"] == 2 * LAYER_BYTES + LAYER_BYTES + LAYER_BYTES + head
    one = plan_json(capsys, _preset(tmp_path), "--ssd-gbps", "1000", "--num-microbatches", "8")
    assert one["offloaded_bytes_per_step"] == 8 * 3 * LAYER_BYTES  # no pipeline: nothing deferred is written


def _preset(tmp_path) -> str:
    path = tmp_path / "pp1.yaml"
    path.write_text(PRESET)
    return str(path)
