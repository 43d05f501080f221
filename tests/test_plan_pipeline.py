"""`ssdtrain plan` for a pipeline's first stage: the deferred last layers it writes, and a plan's
kept layers held for every micro-batch in flight (plan/model.py, tools/plan/cli.py)."""

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


def test_with_a_pipeline_every_layer_may_leave_and_kept_layers_count_per_micro_batch_in_flight(
        capsys, tmp_path):
    """Under 1F1B the first stage runs the other micro-batches' work between a micro-batch's
    forward and its backward: its last layer has time to go and come back, so offload moves it
    too (the offloader writes it once another forward starts). What a plan keeps stays for each
    of the pp micro-batches in flight. Broken variants: keep_last_layers applied with a gap ->
    decisions ['ssd', 'keep']; the peak counting kept layers once -> 2 x L + head, not 3 x L +
    head."""
    path = tmp_path / "pp2.yaml"
    path.write_text(PRESET.replace("pp: 1", "pp: 2"))  # 2 layers per stage
    fast = plan_json(capsys, str(path), "--num-microbatches", "8")
    assert [row["decision"] for row in fast["layers"]] == ["ssd", "ssd"]
    assert fast["tiers"]["ssd"] == 2 * LAYER_BYTES
    keep = plan_json(capsys, str(path), "--num-microbatches", "8", "--policy", "keep")
    head = keep["activation_bytes_per_micro_batch"] - 2 * LAYER_BYTES
    assert keep["peak_bytes"] == 2 * 2 * LAYER_BYTES + head  # 2 micro-batches x 2 layers
    # A budget for one kept layer per micro-batch in flight, one in transit and the head.
    budget = 2 * LAYER_BYTES + LAYER_BYTES + head
    half = plan_json(capsys, str(path), "--num-microbatches", "8", "--policy", "adaptive",
                     "--activation-budget", f"{budget}B")
    assert sorted(row["decision"] for row in half["layers"]) == ["keep", "ssd"]
    assert half["peak_bytes"] == budget
    one = plan_json(capsys, _preset(tmp_path), "--num-microbatches", "8")
    assert [row["decision"] for row in one["layers"]] == ["ssd"] * 3 + ["keep"]  # no pipeline


def _preset(tmp_path) -> str:
    path = tmp_path / "pp1.yaml"
    path.write_text(PRESET)
    return str(path)
