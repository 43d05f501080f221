"""A plain Megatron command line is a job (issue 69): Megatron's flags that move time or
memory are read into the planner's shape, or refused in one line that names them
(megatron/megatron_flags.py via megatron/follow_node.py's door)."""

from __future__ import annotations

import json

import pytest

from ssdtrain_megatron.megatron.follow_node import megatron_model, megatron_namespace
from ssdtrain_megatron.plan.job import JobError
from ssdtrain_megatron.tools.cli import main

BASE = ["--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
        "--ffn-hidden-size", "28672", "--group-query-attention", "--num-query-groups", "8",
        "--seq-length", "8192", "--micro-batch-size", "1", "--global-batch-size", "128",
        "--swiglu", "--bf16", "--vocab-size", "128256"]


def _model(*flags: str, world: int = 64):
    return megatron_model(megatron_namespace([*BASE, *flags], world))


def test_the_vocab_is_padded_as_megatron_pads_it():
    """128,256 is a multiple of 128, not of 128 x 4: TP4 pads to 128,512. Broken variant
    (the vocab unpadded): 128,256 at TP4."""
    assert _model().vocab == 128256
    assert _model("--tensor-model-parallel-size", "4").vocab == 128512
    assert _model("--make-vocab-size-divisible-by", "1000").vocab == 129000


def test_the_virtual_pipeline_comes_from_either_flag_and_they_must_agree():
    pp4 = ("--pipeline-model-parallel-size", "4")
    assert _model(*pp4, "--num-layers-per-virtual-pipeline-stage", "4").vp == 5
    assert _model(*pp4, "--virtual-pipeline-model-parallel-size", "5").vp == 5
    assert _model(*pp4).vp == 1
    with pytest.raises(JobError, match="--num-layers-per-virtual-pipeline-stage 3 does not divide"):
        _model(*pp4, "--num-layers-per-virtual-pipeline-stage", "3")
    with pytest.raises(JobError, match="--virtual-pipeline-model-parallel-size 4 disagrees"):
        _model(*pp4, "--num-layers-per-virtual-pipeline-stage", "4",
               "--virtual-pipeline-model-parallel-size", "4")


def test_precision_overlap_and_attention_flags_are_read():
    """Broken variant (time_fields not merged into the shape): fp8 and the overlaps stay
    False."""
    shape = _model("--tensor-model-parallel-size", "4", "--sequence-parallel", "--fp8-format",
                   "hybrid", "--tp-comm-overlap", "--overlap-grad-reduce", "--overlap-param-gather",
                   "--grad-reduce-in-bf16", "--use-distributed-optimizer", "--attention-dropout",
                   "0", "--hidden-dropout", "0", "--recompute-activations")
    assert (shape.fp8, shape.tp_comm_overlap, shape.overlap_grad_reduce,
            shape.overlap_param_gather, shape.grad_reduce_in_bf16, shape.distributed_optimizer) \
        == (True, True, True, True, True, True)
    assert (shape.attention_dropout, shape.hidden_dropout, shape.recompute) == (0.0, 0.0, "selective")
    assert shape.flash_attention  # Transformer Engine's fused attention, Megatron's default
    assert not _model("--attention-backend", "unfused").flash_attention
    assert not _model("--transformer-impl", "local").flash_attention
    assert _model("--transformer-impl", "local", "--use-flash-attn").flash_attention


@pytest.mark.parametrize("flags, message", [
    (["--num-experts", "8", "--moe-router-topk", "2"],
     "--moe-token-dispatcher-type allgather: not modelled"),
    (["--num-experts", "8", "--moe-token-dispatcher-type", "alltoall",
      "--moe-expert-capacity-factor", "1.0"], "--moe-expert-capacity-factor 1.0: dropping"),
    (["--context-parallel-size", "2", "--cp-comm-type", "a2a"], "--cp-comm-type a2a: not modelled"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers",
      "10"], "recomputing 10 of a stage's 80 layers is not modelled"),
])
def test_what_the_planner_does_not_model_is_refused_in_one_line(flags, message):
    with pytest.raises(JobError, match=message):
        _model(*flags)


def test_plan_takes_a_plain_megatron_command_line_and_prices_the_job_as_given(capsys):
    """No --ssd-offload: the job keeps everything; job_tokens_per_s_per_gpu is its figure
    (the keep iteration), beside the best without offload. Broken variant (launcher_job
    refusing a command line without --ssd-offload, as before): exit 2."""
    argv = [*BASE, "--tensor-model-parallel-size", "4", "--pipeline-model-parallel-size", "8",
            "--sequence-parallel", "--num-layers-per-virtual-pipeline-stage", "2",
            "--use-distributed-optimizer"]
    assert main(["plan", "--node", "dgx-h100", "--gpus", "64", "--json", "--", *argv]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "keep" and out["job_offloads"] is False
    assert out["model"]["vp"] == 5 and out["model"]["vocab"] == 128512
    assert out["job_tokens_per_s_per_gpu"] == pytest.approx(
        128 * 8192 / out["keep_iteration_s"] / 64, rel=1e-12)
    assert set(out["time_terms_s"]["step"]) == {"pipeline_bubble", "pipeline_sends",
                                                "dp_grad_reduce", "dp_param_gather", "optimizer"}
    assert out["without_offload"]["best"] is not None
    assert out["with_offload"] is None or out["with_offload"]["tokens_per_s_per_gpu"] > 0


def test_search_of_a_command_line_tries_context_parallelism_at_8k(capsys):
    """The 8B job of the published runs at 8k tokens: --search ranks CP2 layouts (it tried CP
    only from 16k before). Broken variant (cps [1] below 16k): no CP2 layout ranked."""
    from ssdtrain_megatron.plan.published import PUBLISHED_RUNS

    run = PUBLISHED_RUNS[0]
    assert main(["plan", "--node", "dgx-h100", "--gpus", "8", "--search", "--top", "50",
                 "--json", "--", *run.argv]) == 0
    out = json.loads(capsys.readouterr().out)
    ranked = out["without_offload"] + out["with_offload"]
    assert any(d["cp"] == 2 for d in ranked)
    assert all(d["offloads"] for d in out["with_offload"])


def test_newer_recompute_and_expert_flags_are_read_or_refused():
    with pytest.raises(JobError, match="--recompute-modules moe: only core_attn"):
        _model("--recompute-granularity", "selective", "--recompute-modules", "moe")
    assert _model("--recompute-granularity", "selective", "--recompute-modules",
                  "core_attn").recompute == "selective"
    with pytest.raises(JobError, match="--expert-tensor-parallel-size 1: the planner splits"):
        _model("--tensor-model-parallel-size", "2", "--num-experts", "8",
               "--moe-token-dispatcher-type", "alltoall", "--expert-tensor-parallel-size", "1")
    assert _model("--fp8-param-gather", "--use-distributed-optimizer").fp8_param_gather


def test_the_answer_is_one_value_with_the_job_both_bests_and_the_verdict(capsys):
    """plan/answer.py's Answer as ``plan -- ARGS --json`` gives it: the job's own figure equals
    the top-level one, the gain is the bests' ratio, and the verdict follows the model's error.
    Broken variant (verdict ignoring the error band: "offload pays" above 1): the 8B job's
    x1.03 reads "offload pays"."""
    from ssdtrain_megatron.plan.published import MODEL_ERROR, PUBLISHED_RUNS

    run = PUBLISHED_RUNS[0]
    assert main(["plan", "--node", "dgx-h100", "--gpus", "8", "--json", "--", *run.argv]) == 0
    out = json.loads(capsys.readouterr().out)
    ans = out["answer"]
    assert ans["job_tokens_per_s_per_gpu"] == out["job_tokens_per_s_per_gpu"]
    best, with_ = ans["best_without_offload"], ans["best_with_offload"]
    assert ans["gain"] == pytest.approx(with_["tokens_per_s_per_gpu"] / best["tokens_per_s_per_gpu"])
    assert 1 < ans["gain"] < 1 + MODEL_ERROR.spread
    assert ans["verdict"] == "within the model's error"
    assert ans["model_error"]["median"] == MODEL_ERROR.median
