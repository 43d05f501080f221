"""What the multi-process harnesses' ``Phase.settle_writes`` and Megatron-LM's loop
(``SSDTRAIN_TEST_SETTLE_WRITES``) do: every queued write finishes before a backward is
announced, so what a step writes, reads and wastes does not depend on how far the IO threads
got (the take-back of queued writes has its own tests in tests/test_held.py)."""

from __future__ import annotations


def settle_writes_before_backward(offloader) -> None:
    """Make ``offloader.begin_backward`` wait for every queued write first."""
    announce = offloader.begin_backward

    def begin_backward_after_writes(key) -> None:
        offloader.wait_writes()
        announce(key)

    offloader.begin_backward = begin_backward_after_writes
