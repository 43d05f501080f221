"""Pinned staging larger than the host memory per rank is refused where staging is pinned (a
CUDA device, a plan of a node profile: tests/test_every_flag_in_plan.py), not at install on a
device without CUDA, where the offloader allocates no staging (cache/offloader.py): the demo
and CPU training on a machine with little free memory run. The accounting stays the same, so
the settings equal the plan's either way. The launcher's real install path
(tests/test_one_sequence.py's installer, which returns the config) on this CPU machine; the
CUDA device is a stand-in (``cuda_here`` patched to True), the one thing that needs a GPU."""

from __future__ import annotations

import pytest

from ssdtrain_megatron.megatron import follow_node
from ssdtrain_megatron.megatron.host_memory import HostMemory
from ssdtrain_megatron.megatron.launch import LaunchError
from tests.test_one_sequence import install_path

ARGV = ["--ssd-offload", "--ssd-offload-config", "llama3-70b", "--micro-batch-size", "1"]
TINY = HostMemory(2 * 10 ** 9, 8, "$SSDTRAIN_HOST_MEMORY_FREE")
"""2 GB free for 8 local ranks: 187.5 MB per rank usable, against the preset's 8.6 GB of staging."""


def test_the_cpu_install_path_with_little_host_memory_is_not_refused():
    """Broken variant (the condition ``not job.staging_pinned`` dropped from plan/job.py's
    _check_host): LaunchError "pinned staging of 8.6 GB per rank ... is more than the 187.5 MB"."""
    assert follow_node.cuda_here() is False  # this machine: torch without CUDA
    config = install_path(ARGV, 32, TINY)
    assert (config.engine, config.staging_bytes()) == ("posix", 8_589_934_592)


def test_the_same_install_on_a_cuda_device_is_refused_in_one_line(monkeypatch):
    """Broken variant (``staging_pinned`` always False): installs."""
    monkeypatch.setattr(follow_node, "cuda_here", lambda: True)  # a stand-in for a CUDA device
    with pytest.raises(LaunchError) as refused:
        install_path(ARGV, 32, TINY)
    assert str(refused.value) == (
        "pinned staging of 8.6 GB per rank (twice max_inflight_bytes, set by the preset) is more "
        "than the 187.5 MB of host memory per rank (2.0 GB host memory free "
        "($SSDTRAIN_HOST_MEMORY_FREE) for 8 local rank(s)): set "
        "--ssd-offload-pinned-staging-bytes to at most 187.5 MB")
