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
