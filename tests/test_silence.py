"""Offload that does not happen says why (issue 28, section 1): every tensor left to autograd
is counted by reason, and a step after the first that offloads nothing, or an offload layer
that records nothing, is explained in StepStats.not_offloaded_why and warned once per job.

The device reason uses a meta-device tensor as "another device" (CUDA does not run here); the
check compares devices only, so what a GPU run shows is the same path with cuda:0."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from ssdtrain_megatron import ActivationOffloader
from ssdtrain_megatron.telemetry.stats import PASS_REASONS
from tests.test_offloader import cfg, files_under

WARN = "ssdtrain_megatron.cache.silence"


def _steps(off, body, n=2):
    out = []
    for _ in range(n):
        with off.microbatch(0):
            with off.layer(0):
                loss = body()
        loss.backward()
        out.append(off.end_step())
    return out


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.name == WARN]


def test_small_tensors_are_counted_and_the_second_step_says_lower_min_tensor_bytes(offload_dir, caplog):
    """Break: count "small" as "parameter" in hooks.py -> the by-reason dict assertion fails."""
    lin = nn.Linear(64, 64)
    x = torch.randn(8, 64, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger=WARN):
        with ActivationOffloader(cfg(offload_dir, min_tensor_bytes=1 << 30, keep_last_layers=0)) as off:
            first, second, third = _steps(off, lambda: lin(x).sin().sum(), n=3)
    assert first.passed_through_by_reason == {"small": second.tensors_passed_through}
    assert first.not_offloaded_why == ""  # the first step is exempt
    assert "min_tensor_bytes=1073741824" in second.not_offloaded_why
    assert "--ssd-offload-min-tensor-bytes" in second.not_offloaded_why
    assert third.not_offloaded_why == second.not_offloaded_why.replace("step 2", "step 3")
    assert _warnings(caplog) == ["ssdtrain: " + second.not_offloaded_why]  # once per job
    assert "NOT OFFLOADING" in second.summary() and "small 3" in second.summary()


def test_tensors_on_another_device_name_both_devices(offload_dir, caplog):
    """The issue's case: the device looked like cuda, the tensors were elsewhere. Here the
    offloader's device is meta (a stand-in) and the tensors are on the CPU.
    Break: drop the detail in _pass_other -> "saved tensors are on cpu" is missing."""
    x = torch.randn(256, 256, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger=WARN):
        with ActivationOffloader(cfg(offload_dir, keep_last_layers=0), device=torch.device("meta")) as off:
            _, second = _steps(off, lambda: x.mul(2).sin().sum())
    assert set(second.passed_through_by_reason) == {"device"}
    assert "saved tensors are on cpu, the offloader's device is meta" in second.not_offloaded_why
    assert len(_warnings(caplog)) == 1


def test_parameters_and_recompute_and_held_are_counted_by_reason(offload_dir):
    """Break: count recompute as "small" in hooks.py -> "recompute" is missing from the dict."""
    from torch.utils.checkpoint import checkpoint

    lin = nn.Linear(256, 256)
    held = torch.randn(256, 256, requires_grad=True)
    with ActivationOffloader(cfg(offload_dir, min_tensor_bytes=1024, keep_last_layers=0)) as off:
        off.register_parameters(lin.parameters())
        for _ in range(2):
            h = torch.randn(256, 256)  # the schedule's: held until backward
            off.register_held([h])
            with off.microbatch(0):
                with off.layer(0):
                    y = checkpoint(lambda t: lin(t).sin(), held.mul(1), use_reentrant=True)
                    loss = (y * h).sum() + lin(held.sin()).sum()  # h (held), lin.weight, a sin

                # Backward inside the hooks: the reentrant checkpoint's recompute pass is seen.
                off.wait_writes()  # the sin output written, not taken back by backward
                loss.backward()
            st = off.end_step()
    by = st.passed_through_by_reason
    assert by["parameter"] >= 1 and by["recompute"] >= 1 and by["held_by_schedule"] == 1, by
    assert sum(by.values()) == st.tensors_passed_through
    assert set(by) <= set(PASS_REASONS)
    assert st.tensors_offloaded > 0 and st.not_offloaded_why == ""


def test_an_offload_layer_that_records_nothing_is_named_with_its_reason(offload_dir, caplog):
    """Layer 1 saves only small tensors, layer 0 a large one: the step offloads, but layer 1
    moved no bytes. Break: skip the per-layer loop in silence.py -> why is ''."""
    big = torch.randn(512, 512, requires_grad=True)
    small = torch.randn(4, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger=WARN):
        with ActivationOffloader(cfg(offload_dir, min_tensor_bytes=4096, keep_last_layers=0)) as off:
            for _ in range(2):
                with off.microbatch(0):
                    with off.layer(0):
                        a = big.mul(2).sin()
                    with off.layer(1):
                        b = small.mul(2).sin()
                off.wait_writes()  # written before backward: read back, not forwarded
                (a.sum() + b.sum()).backward()
                st = off.end_step()
        assert files_under(offload_dir) == []
    assert st.bytes_offloaded > 0 and st.bytes_read > 0
    assert st.not_offloaded_why.startswith("layer 1 (decision offload) moved no bytes in step 2")
    assert "below min_tensor_bytes=4096" in st.not_offloaded_why
    assert len(_warnings(caplog)) == 1


def test_a_step_with_no_save_inside_the_hooks_says_so(offload_dir):
    x = torch.randn(256, 256, requires_grad=True)
    with ActivationOffloader(cfg(offload_dir, keep_last_layers=0)) as off:
        off.end_step()
        x.mul(2).sin().sum().backward()  # outside microbatch(): the hooks never see it
        st = off.end_step()
    assert "no tensor was saved inside offloader.microbatch()" in st.not_offloaded_why


def test_policy_keep_never_warns(offload_dir, caplog):
    x = torch.randn(256, 256, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger=WARN):
        with ActivationOffloader(cfg(offload_dir, policy="keep", min_tensor_bytes=1 << 30)) as off:
            _, second = _steps(off, lambda: x.mul(2).sin().sum())
    assert second.not_offloaded_why == "" and _warnings(caplog) == []


@pytest.mark.parametrize("reason", PASS_REASONS)
def test_every_reason_has_a_fix_in_words(reason):
    from ssdtrain_megatron.cache.silence import reason_text

    assert not reason_text(reason, "cpu", torch.device("cuda", 0), 1).startswith("reason ")


def test_report_stats_shows_the_reasons_and_why_nothing_was_offloaded(offload_dir, tmp_path, capsys):
    """Break: drop the not_offloaded_why loop in render_stats_summary -> NOT OFFLOADING missing."""
    import argparse
    import json

    from ssdtrain_megatron.tools.report import add_report_parser

    stats = str(tmp_path / "stats.jsonl")
    x = torch.randn(64, 64, requires_grad=True)
    with ActivationOffloader(cfg(offload_dir, stats_path=stats, min_tensor_bytes=1 << 30)) as off:
        _, second = _steps(off, lambda: x.mul(2).sin().sum())
    parser = argparse.ArgumentParser()
    add_report_parser(parser.add_subparsers())
    for extra in ([], ["--json"]):
        args = parser.parse_args(["report", "--stats", stats, *extra])
        assert args.func(args) == 0
    text, js = capsys.readouterr().out.split("\n{", 1)
    assert "Saved tensors left to autograd: 2 (small: 2)" in text
    assert f"- NOT OFFLOADING (iteration 2): {second.not_offloaded_why}" in text
    obj = json.loads("{" + js)
    assert obj["passed_through_by_reason"] == {"small": 2}
    assert obj["not_offloaded"] == [{"why": second.not_offloaded_why, "iterations": [2]}]


def test_tensorboard_gets_one_scalar_per_reason_and_no_text():
    """Break: drop the passed_through loop in megatron/telemetry.step_scalars -> KeyError."""
    import dataclasses

    from ssdtrain_megatron.megatron.telemetry import step_scalars
    from ssdtrain_megatron.telemetry.stats import StepCounters

    st = StepCounters().freeze(1, (0, 0.0), (0, 0.0), 0, 1.0)
    st = dataclasses.replace(st, passed_through_by_reason={"small": 3, "device": 1},
                             not_offloaded_why="step 2 offloaded nothing: ...")
    scalars = step_scalars(st)
    assert scalars["ssd_offload/passed_through/small"] == 3
    assert scalars["ssd_offload/passed_through/device"] == 1
    assert all(isinstance(v, (int, float)) for v in scalars.values())
    assert "ssd_offload/not_offloaded_why" not in scalars
