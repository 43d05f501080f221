"""``ssdtrain plan`` plans the job you will run (issue 49): an engine the preset does not name
follows the node as the job's would, a named one that plans slower says so, and the GPUs and
global batch are Megatron's (--gpus or --nodes, --global-batch-size), or the first line says
what was assumed. The real parser and planner on the real presets."""

from __future__ import annotations

import json

import pytest

from ssdtrain_megatron.tools.cli import main

ISSUE = ("--config", "llama3-70b", "--node", "dgx-h100", "--num-microbatches", "8",
         "--micro-batch-size", "4")


def _json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _lines(capsys, *argv):
    assert main(["plan", *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_the_issues_plan_puts_layers_in_host_memory_without_an_engine_flag(capsys):
    """llama3-70b names no engine: on a DGX H100 (150 GB of host memory per GPU) the plan is the
    tiered engine's, all four places, as fast as keeping everything. Broken variant (the plan
    back on the preset's engine, posix by default): 16 layers recomputed, x1.204 keep."""
    out = _json(capsys, *ISSUE)
    assert (out["engine"], out["policy"], out["places"]) == \
        ("tiered", "adaptive", ["keep", "host", "ssd", "recompute"])
    assert out["tiers"]["host"] > 0 and out["tiers"]["recompute"] == 0
    assert out["vs_keep"] == pytest.approx(1.0)
    choice = out["engine_choice"]
    assert choice["followed_the_node"] and choice["reason"].startswith(
        "engine tiered: 150.0 GB host memory per GPU (dgx-h100), ")
    assert choice["host_memory_bytes"] >= out["host_peak_bytes"] > 0
    assert out["slower_than_the_node"] is None


def test_a_named_engine_is_planned_and_said_to_be_slower_than_the_nodes(capsys):
    """--engine posix (or a preset's engine: posix) plans posix; the last line says the node's
    choice would plan x1.000 keep. Broken variant (no comparison): no such line."""
    lines = _lines(capsys, *ISSUE, "--engine", "posix")
    assert lines[3] == "policy adaptive, engine posix: places keep, ssd, recompute"
    assert lines[4] == "engine posix: named by --engine (posix)"
    assert lines[-1].startswith("slower than the node's       engine posix, named by --engine "
                                "(posix), plans x1.198 keep; without it the engine follows the "
                                "node: engine tiered: 150.0 GB host memory per GPU (dgx-h100)")
    assert lines[-1].endswith("; x1.000 keep")
    as_fast = _json(capsys, *ISSUE, "--engine", "tiered")
    assert as_fast["slower_than_the_node"] is None  # the node's choice is no faster


def test_a_preset_that_names_its_engine_is_honoured(capsys, tmp_path):
    with open("configs/llama3-70b.yaml", encoding="utf-8") as fh:
        text = fh.read()
    preset = tmp_path / "posix-70b.yaml"
    preset.write_text(text.replace("offload:\n", "offload:\n  engine: posix\n", 1))
    out = _json(capsys, *ISSUE[2:], "--config", str(preset))
    assert out["engine"] == "posix" and out["engine_choice"]["reason"] == \
        "engine posix: named by the preset (posix)"
    assert out["slower_than_the_node"]["engine"] == "tiered"


def test_a_node_without_host_memory_plans_posix_and_says_why(capsys):
    out = _json(capsys, *ISSUE, "--host-memory", "9GB")
    assert (out["engine"], out["places"]) == ("posix", ["keep", "ssd", "recompute"])
    assert out["engine_choice"]["reason"] == (
        "engine posix: 9.0 GB host memory per GPU (--host-memory), 410.1 MB per rank for offload, "
        "less than one layer's activations (1.1 GB)")  # the 8.6 GB of pinned staging come first


def test_search_ranks_layouts_at_the_global_batch_and_gpus_given(capsys):
    """Every layout ranked runs 512 sequences per iteration on 64 GPUs; --nodes 8 is the same
    job. Broken variant (the search back on the preset's dp x b x m): 'global_batch': 2."""
    out = _json(capsys, "--config", "llama3-70b", "--search", "--gpus", "64",
                "--global-batch-size", "512", "--top", "50")
    assert (out["gpus"], out["global_batch"], out["assumed"]) == (64, 512, "")
    for d in out["without_offload"] + out["with_offload"]:
        assert d["tp"] * d["pp"] * d["cp"] * d["dp"] == 64
        assert d["dp"] * d["micro_batch"] * d["num_micro_batches"] == 512
    by_nodes = _json(capsys, "--config", "llama3-70b", "--search", "--nodes", "8",
                     "--global-batch-size", "512", "--top", "50")
    assert by_nodes == out


def test_without_them_the_first_line_says_what_was_assumed(capsys):
    search = _lines(capsys, "--config", "llama3-70b", "--search", "--num-microbatches", "8")
    assert "on 64 GPUs of dgx-h100" in search[0] and " 16 sequences of 8192 tokens" in search[0]
    assert ("(assumed: 64 GPUs = the preset's dp 2 x tp 8 x pp 4; 16 sequences = dp 2 x "
            "micro-batch 1 x 8 micro-batch(es) (--gpus or --nodes, --global-batch-size: the job "
            "you will run))") in search[0]
    plan = _lines(capsys, *ISSUE)
    assert plan[0].endswith("; 64 GPUs, a global batch of 64 x 8192 tokens (assumed: 64 GPUs = "
                            "the preset's dp 2 x tp 8 x pp 4; 64 sequences = dp 2 x micro-batch "
                            "4 x 8 micro-batch(es) (--gpus or --nodes, --global-batch-size: the "
                            "job you will run)), micro-batch 4 (--micro-batch-size), 8 "
                            "micro-batch(es) per iteration")
    given = _lines(capsys, *ISSUE[:4], "--micro-batch-size", "4", "--gpus", "64",
                   "--global-batch-size", "64")
    assert given[0].endswith("; 64 GPUs, a global batch of 64 x 8192 tokens, micro-batch 4 "
                             "(--micro-batch-size), 8 micro-batch(es) per iteration")


def test_the_gpus_and_global_batch_size_the_plan_of_the_presets_layout(capsys):
    """128 GPUs of the preset's TP8 PP4: 4 replicas (the distributed optimizer's shards), and
    512 sequences of micro-batch 1 are 128 micro-batches per replica."""
    out = _json(capsys, "--config", "llama3-70b", "--gpus", "128", "--global-batch-size", "512")
    assert (out["model"]["dp"], out["num_micro_batches"]) == (4, 128)
    assert (out["gpus"], out["global_batch"], out["assumed"]) == (128, 512, "")


@pytest.mark.parametrize("flags, says", [
    (("--global-batch-size", "100", "--micro-batch-size", "4"),
     "--global-batch-size 100 is not a multiple of micro-batch 4 x data-parallel size 2 = 8 "
     "(Megatron's rule)"),
    (("--gpus", "64", "--nodes", "4"), "--gpus 64 and --nodes 4 disagree: 4 node(s) of 8 GPUs "
                                       "(--gpus-per-node) are 32"),
    (("--global-batch-size", "64", "--num-microbatches", "3"),
     "--num-microbatches 3 disagrees with --global-batch-size 64: 64 / (micro-batch 1 x "
     "data-parallel size 2) = 32"),
    (("--gpus", "64", "--data-parallel-size", "4"),
     "--data-parallel-size 4 disagrees with 64 GPUs: the preset's model-parallel size 32 makes "
     "2 replicas"),
])
def test_a_job_megatron_would_refuse_is_one_line_naming_the_rule(capsys, flags, says):
    assert main(["plan", "--config", "llama3-70b", *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"ssdtrain plan: error: {says}"]
