"""`ssdtrain soak`, short (issue 28, section 2): faults of every kind injected into a
megatron-core GPT's offloaded training on this CPU; every step that completes is bitwise equal
to the fault-free run, every failure is an error, no file is left. The 200-step run of the
issue is the command in docs/commands.md; CI runs this one."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from ssdtrain_megatron.tools.cli import main  # noqa: E402
from ssdtrain_megatron.tools.faults import KINDS  # noqa: E402


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_soak_short_survives_every_kind_bitwise_and_leaves_no_file(tmp_path, capsys):
    """Break: in io/posix.py, accept a short read (drop its `raise EngineError(... short read`)
    -> a half-read tensor reaches backward: lost_steps is not empty and the exit status is 1."""
    out = tmp_path / "soak.json"
    rc = main(["soak", "--steps", "8", "--faults", "all", "--seed", "1", "--rate", "0.03",
               "--stall-rate", "0.003", "--io-timeout-s", "0.5", "--dir", str(tmp_path / "ssd"),
               "--json", "--out", str(out)])
    r = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert r == json.loads(out.read_text())
    assert set(r["faults_injected"]) == set(KINDS)
    assert all(r["faults_injected"][k] > 0 for k in KINDS if k != "stall"), r["faults_injected"]
    assert r["lost"] == 0 and r["lost_steps"] == [] and r["files_left"] == 0, r
    assert r["bitwise_equal_steps"] == r["survivable_steps"] >= 1, r
    assert r["survivable_steps"] + r["failed_steps"] == 8
    assert r["fallbacks"] > 0 and r["read_retries"] > 0  # writes kept in memory, reads retried
    for f in r["failed_loudly"]:  # a loud failure names what failed
        assert f["error"].startswith(("RuntimeError: reading back", "IOTimeout: waited")), f
    assert rc == r["exit_status"] == 0


def test_soak_refuses_an_unknown_fault_kind(capsys):
    assert main(["soak", "--faults", "write_eio,bitrot"]) == 2
    assert "unknown kind bitrot" in capsys.readouterr().err


def _soak_json(argv, capsys):
    rc = main(["soak", "--steps", "2", "--faults", "all", "--seed", "1", "--rate", "0.03",
               "--stall-rate", "0", "--io-timeout-s", "0.5", "--json", *argv])
    return rc, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_soak_config_runs_the_presets_kind_of_model_shrunk_to_cpu_size(tmp_path, capsys):
    """``--config configs/llama2-7b.yaml``: SwiGLU kept, 4 of 32 layers, TP 2 and sequence
    parallel named as shrunk away; faults injected, nothing lost, every survived step bitwise
    equal to the fault-free run of the same shrunk model. Break: drop ``swiglu=...`` in
    soak.preset_spec -> the result's shape has swiglu False."""
    rc, r = _soak_json(["--config", "configs/llama2-7b.yaml", "--dir", str(tmp_path)], capsys)
    assert r["config"] == "configs/llama2-7b.yaml" and r["engine"] == "posix"
    assert r["shape"] == {"layers": 4, "hidden": 64, "seq": 64, "micro_batch": 2, "recompute": None,
                          "swiglu": True}
    assert "tp 2 -> 1 (one process)" in r["shrunk"] and "sequence parallel -> off" in r["shrunk"]
    assert r["faults_total"] > 0 and r["bytes_offloaded"] > 0
    assert r["lost"] == 0 and r["bitwise_equal_steps"] == r["survivable_steps"], r
    assert rc == r["exit_status"] == 0


@pytest.mark.aio
@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_soak_injects_faults_into_the_aio_engine_too(tmp_path, capsys):
    """DeepNVMe's aio engine under the same faults (its C submission path refuses the call):
    nothing lost, failures loud. Break: make soak_config ignore --engine -> engine 'posix'."""
    from ssdtrain_megatron.io import engine_class

    ok, why = engine_class("aio").is_available()
    if not ok:
        pytest.skip(f"engine 'aio' cannot run here: {why}")
    rc, r = _soak_json(["--config", "configs/cpu-tiny.yaml", "--engine", "aio", "--dir", str(tmp_path)], capsys)
    assert r["engine"] == "aio" and r["faults_total"] > 0 and r["bytes_offloaded"] > 0, r
    assert r["lost"] == 0 and r["files_left"] == 0 and r["bitwise_equal_steps"] == r["survivable_steps"], r
    for f in r["failed_loudly"]:
        assert f["error"].startswith(("RuntimeError: reading back", "IOTimeout: waited")), f
    assert rc == 0


def test_soak_refuses_an_engine_it_cannot_inject_faults_into(tmp_path, capsys):
    preset = tmp_path / "mem.yaml"
    preset.write_text("model:\n  num_layers: 2\n  hidden: 64\n  heads: 4\n  ffn_hidden: 256\n"
                      "  seq_len: 32\n  micro_batch: 2\noffload:\n  engine: memory\n")
    assert main(["soak", "--steps", "1", "--config", str(preset)]) == 2
    assert "faults are injected into the IO calls of posix, aio, tiered only" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["soak", "--engine", "memory"])
    assert exc.value.code == 2
