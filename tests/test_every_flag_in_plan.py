"""Every flag the job runs with is in the plan, and refusals come in the format asked for
(issue 66, items 3 and 4). Each case through the real CLIs (``ssdtrain plan ... -- ARGS``,
``ssdtrain doctor --preflight --json -- ARGS``) and the launcher's pre-flight (megatron/
preflight.py ``read_launch``), which all take their settings from plan/job.py
``job_settings``. Host memory free is ``SSDTRAIN_HOST_MEMORY_FREE`` (the job's override of
/proc/meminfo)."""

from __future__ import annotations

import json
import logging
from typing import List

import pytest

from cli_helpers import run_cli
from ssdtrain_megatron.megatron.preflight import FlagError, disk_peak_bytes, read_launch

GB = 10 ** 9
RECOMPUTE_3 = ["--ssd-offload", "--ssd-offload-config", "llama3-8b", "--ssd-offload-policy",
               "offload", "--ssd-offload-recompute-layers", "1,2,3", "--micro-batch-size", "1",
               "--global-batch-size", "64"]
"""The issue's llama3-8b job on 16 GPUs with three layers named to recompute."""
POOL_50GB = ["--ssd-offload", "--ssd-offload-config", "llama3-8b-128k", "--ssd-offload-engine",
             "tiered", "--ssd-offload-host-memory-bytes", "50GB", "--ssd-offload-policy",
             "offload", "--tensor-model-parallel-size", "2", "--context-parallel-size", "4",
             "--micro-batch-size", "1", "--global-batch-size", "8"]
"""The issue's llama3-8b-128k job, TP2 CP4 on 8 GPUs, with a named 50 GB host pool."""


def plan_json(capsys, gpus: int, args: List[str]) -> dict:
    code, out, err = run_cli(["plan", "--gpus", str(gpus), "--json", "--", *args], capsys)
    assert code == 0, err
    return json.loads(out)


def launch_of(args: List[str], free: str, ranks: int, world: int):
    return read_launch(args, environ={"SSDTRAIN_HOST_MEMORY_FREE": free,
                                      "LOCAL_WORLD_SIZE": str(ranks)}, world=world)


# -- item 3 ---------------------------------------------------------------------------------

def test_recompute_layers_without_the_fallback_are_refused_by_plan_and_preflight(capsys):
    """Broken variant (a975649): the flag dropped, layers 1-3 planned in host memory."""
    said = ("--ssd-offload-recompute-layers 1,2,3: layers run recomputed only with the "
            "recompute fallback, which is off here: add --ssd-offload-recompute-fallback, or drop "
            "--ssd-offload-recompute-layers")
    code, out, err = run_cli(["plan", "--gpus", "16", "--", *RECOMPUTE_3], capsys)
    assert (code, out, err) == (2, "", f"ssdtrain plan: error: {said}\n")
    with pytest.raises(FlagError) as refused:
        launch_of(RECOMPUTE_3, "1.6TB", 8, 16)
    assert str(refused.value) == said


def test_recompute_layers_with_the_fallback_are_recomputed_in_the_places(capsys):
    """Broken variant (a975649): places h,h,h,... while install() checkpoints layers 1-3."""
    args = [*RECOMPUTE_3, "--ssd-offload-recompute-fallback"]
    out = plan_json(capsys, 16, args)
    assert out["settings"]["places"][:4] == ["recompute", "recompute", "recompute", "host"]
    assert out["tiers"]["recompute"] > 0 and out["recompute_s"] > 0
    launch = launch_of(args, "1.6TB", 8, 16)
    assert list(launch.settings.places) == out["settings"]["places"]


def test_a_named_host_pool_bounds_the_host_places_and_the_rest_goes_on_the_drives(capsys):
    """Broken variant (a975649): 77.0 GB per GPU in host memory "of 145.7 GB", nothing on
    the drives, and the pre-flight's free-space check counting none."""
    out = plan_json(capsys, 8, POOL_50GB)
    assert out["host_capacity_bytes"] == 50 * GB
    assert 45 * GB < out["host_peak_bytes"] <= 50 * GB
    assert out["tiers"]["ssd"] > 20 * GB
    assert out["host_memory_source"].startswith("the host pool named by "
                                                "--ssd-offload-host-memory-bytes, of 150.0 GB "
                                                "per GPU")
    launch = launch_of(POOL_50GB, "1.6TB", 8, 8)
    st = launch.settings.stage
    ssd_layers = out["settings"]["places"].count("ssd")
    assert ssd_layers > 0
    assert disk_peak_bytes(launch) == ssd_layers * st.layer_bytes * st.positions[0].live


def test_pinned_staging_of_every_local_rank_beyond_host_memory_is_refused_alike(capsys):
    """llama3-70b pins 8.6 GB per rank: 8 local ranks on a node with 22.9 GB free (2.1 GB per
    rank usable) cannot. Broken variant (a975649): both passed with a note."""
    with pytest.raises(FlagError) as refused:
        launch_of(["--ssd-offload", "--ssd-offload-config", "llama3-70b"], "22.9GB", 8, 64)
    assert str(refused.value) == (
        "pinned staging of 8.6 GB per rank (twice max_inflight_bytes, set by the preset) is "
        "more than the 2.1 GB of host memory per rank (22.9 GB host memory free "
        "($SSDTRAIN_HOST_MEMORY_FREE) for 8 local rank(s)): set "
        "--ssd-offload-pinned-staging-bytes to at most 2.1 GB")
    code, out, err = run_cli(["plan", "--config", "llama3-70b", "--host-memory", "2GB"], capsys)
    assert (code, out) == (2, "")
    assert err == ("ssdtrain plan: error: pinned staging of 8.6 GB per rank (twice "
                   "max_inflight_bytes, set by the preset) is more than the 2.0 GB of host "
                   "memory per rank (2.0 GB host memory per GPU (--host-memory)): set "
                   "--ssd-offload-pinned-staging-bytes to at most 2.0 GB\n")


@pytest.mark.parametrize("flags, says", [
    ([], "0.0 GB of 145.7 GB: 150.0 GB per GPU (the dgx-h100 profile's; a job measures its "
         "node's at start) less 4.3 GB of pinned staging"),
    (["--host-memory", "100GB"], "0.0 GB of 95.7 GB: 100.0 GB per GPU (--host-memory) less "
                                 "4.3 GB of pinned staging"),
])
def test_the_memory_line_names_the_host_memory_the_plan_used(capsys, flags, says):
    """Broken variant (a975649): "0.0 GB of 145.7 GB", whose figure from where unsaid."""
    code, out, _ = run_cli(["plan", "--config", "llama3-8b", "--node", "dgx-h100", *flags],
                           capsys)
    assert code == 0
    assert f"\nhost memory per GPU          {says}\n" in out


# -- item 4 ---------------------------------------------------------------------------------

def test_a_json_plan_refusal_is_a_json_object_and_exits_2(capsys):
    """Broken variant (a975649): the one line on stderr, nothing on stdout."""
    code, out, err = run_cli(["plan", "--config", "llama3-70b", "--host-memory", "2GB",
                              "--json"], capsys)
    assert (code, err) == (2, "")
    assert json.loads(out) == {
        "error": "pinned staging of 8.6 GB per rank (twice max_inflight_bytes, set by the "
                 "preset) is more than the 2.0 GB of host memory per rank (2.0 GB host memory "
                 "per GPU (--host-memory)): set --ssd-offload-pinned-staging-bytes to at most "
                 "2.0 GB",
        "flag": "--ssd-offload-pinned-staging-bytes",
        "fix": "set --ssd-offload-pinned-staging-bytes to at most 2.0 GB"}
    code, out, err = run_cli(["plan", "--config", "llama3-8b", "--search", "--micro-batch-size",
                              "2", "--json"], capsys)
    assert (code, err) == (2, "")
    assert {k: v for k, v in json.loads(out).items() if k != "error"} == {
        "flag": "--micro-batch-size",
        "fix": "give no --micro-batch-size with --search, or plan that micro-batch without --search"}


def test_a_json_preflight_refusal_is_a_json_object_and_exits_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SSDTRAIN_HOST_MEMORY_FREE", "22.9GB")
    code, out, err = run_cli(["doctor", "--preflight", "--json", "--nproc-per-node", "8", "--",
                              "--ssd-offload", "--ssd-offload-config", "llama3-70b",
                              "--ssd-offload-dir", str(tmp_path)], capsys)
    assert (code, err) == (2, "")
    refusal = json.loads(out)
    assert refusal["flag"] == "--ssd-offload-pinned-staging-bytes"
    assert refusal["fix"] == "set --ssd-offload-pinned-staging-bytes to at most 2.1 GB"
    assert refusal["error"].endswith(refusal["fix"]) and "pinned staging of 8.6 GB" in refusal["error"]


def test_tensor_parallel_1_turns_a_presets_sequence_parallelism_off_with_one_warning(capsys, caplog):
    """llama3-8b's preset says sequence_parallel: true; Megatron with TP 1 turns it off and
    warns. Broken variant (a975649): refused, "sequence_parallel ... needs tp > 1"."""
    with caplog.at_level(logging.WARNING, logger="ssdtrain_megatron"):
        out = plan_json(capsys, 8, ["--ssd-offload", "--ssd-offload-config", "llama3-8b",
                                    "--tensor-model-parallel-size", "1", "--micro-batch-size",
                                    "1", "--global-batch-size", "64"])
    assert (out["model"]["tp"], out["model"]["sequence_parallel"]) == (1, False)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warned == ["sequence parallelism turned off: --tensor-model-parallel-size 1 leaves "
                      "nothing to split the sequence over (Megatron disables it the same way)"]
