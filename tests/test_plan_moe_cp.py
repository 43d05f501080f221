"""The planner's shape checks and compute split for mixture of experts and context parallelism
(the byte terms are pinned in test_plan_vs_megatron.py and test_presets.py)."""

import pytest

from ssdtrain_megatron.plan.model import ModelShape, estimate_step_time_s


def test_context_parallel_needs_flash_attention_and_a_dividing_sequence():
    base = dict(num_layers=2, hidden=64, heads=4, ffn_hidden=256, seq_len=1024, micro_batch=1)
    with pytest.raises(ValueError, match="cp=2.*flash_attention"):
        ModelShape(**base, cp=2)
    with pytest.raises(ValueError, match="cp=3.*divides seq_len"):
        ModelShape(**base, cp=3, flash_attention=True)
    with pytest.raises(ValueError, match="ep=3.*divides num_experts"):
        ModelShape(**base, num_experts=4, ep=3)
    with pytest.raises(ValueError, match="moe_topk=5"):
        ModelShape(**base, num_experts=4, moe_topk=5)


def test_context_parallel_step_time_splits_over_cp_ranks():
    shape = ModelShape(num_layers=2, hidden=64, heads=4, ffn_hidden=256, seq_len=1024,
                       micro_batch=1, flash_attention=True)
    assert estimate_step_time_s(shape.replace(cp=4), 100.0) * 4 == \
        pytest.approx(estimate_step_time_s(shape, 100.0))
