"""SIGTERM delivered to a training process at one chosen point of one iteration, as a cluster's
preemption would deliver it, but at a point chosen in advance, so that a test can name it.

``tests/megatron_lm_wheel_pretrain.py`` arms it from ``SSDTRAIN_TEST_PREEMPT=POINT@ITERATION``
(iterations counted from 1, as Megatron logs them) and tells it where training is
(:meth:`Preemption.at`). The signal is sent once, to this process, with ``os.kill``: the
handlers run as for a signal from outside (Megatron's ``DistributedSignalHandler``, and ours in
front of it when offload is on). Every rank that reaches the point sends itself the signal;
Megatron's handler gathers the flags of all ranks at the end of the iteration, so a point that
only some ranks reach (the loss: the last pipeline stage) still ends the run on every rank.

The points (:data:`POINTS`):

- ``batch``: reading micro-batch 0's data (``get_batch``);
- ``forward`` / ``forward-last``: right after the last transformer layer's forward of
  micro-batch 1 / of the iteration's last micro-batch (the layer's activations are saved);
- ``loss``: inside the loss function of micro-batch 1 (last stage only);
- ``backward`` / ``backward-last``: inside autograd's backward of micro-batch 0 / of the last
  micro-batch, when the gradient reaches the first transformer layer's output;
- ``optimizer`` / ``after-optimizer``: right before / right after the optimizer's step
  (torch's global optimizer step hooks: Megatron's optimizer calls torch's);
- ``write`` / ``read``: on an IO thread of the posix engine, inside the iteration's first
  ``pwritev`` / ``preadv`` call: the thread sends the signal and holds the IO until the main
  thread has run the handlers (Megatron's flag is set), so they run while that write or that
  prefetch read is in flight. Offloaded runs only.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Optional

POINTS = ("batch", "forward", "forward-last", "loss", "backward", "backward-last", "optimizer",
          "after-optimizer", "write", "read")
HOLD_IO_S = 20.0
"""How long an IO thread holds its write or read for the main thread to handle the signal."""


class Preemption:
    """One SIGTERM at ``point`` of ``iteration``; :meth:`at` is told where training is."""

    def __init__(self, spec: str) -> None:
        point, _, iteration = spec.partition("@")
        if point not in POINTS or not iteration.isdigit():
            raise ValueError(f"SSDTRAIN_TEST_PREEMPT={spec!r}: expected POINT@ITERATION with "
                             f"POINT one of {', '.join(POINTS)}")
        self.point, self.iteration = point, int(iteration)
        self.current = (0, 0)  # (iteration from 1, micro-batch from 0) of the running forward
        self.last_microbatch = 0
        self.optimizer_steps = 0
        self._sent = threading.Event()
        self._lock = threading.Lock()  # two IO threads may reach the point at once

    @classmethod
    def from_environment(cls) -> Optional["Preemption"]:
        spec = os.environ.get("SSDTRAIN_TEST_PREEMPT")
        return cls(spec) if spec else None

    def at(self, iteration: int, microbatch: int, microbatches: int) -> None:
        self.current = (iteration, microbatch)
        self.last_microbatch = microbatches - 1

    def armed(self, point: str, microbatch: Optional[int] = None) -> bool:
        if self.point != point or self._sent.is_set() or self.current[0] != self.iteration:
            return False
        return microbatch is None or self.current[1] == microbatch

    def send(self) -> bool:
        """Send the signal unless it was sent; whether this call sent it."""
        with self._lock:
            if self._sent.is_set():
                return False
            self._sent.set()
        os.kill(os.getpid(), signal.SIGTERM)
        return True

    # -- the hooks --------------------------------------------------------------------------

    def hook_model(self, model) -> None:
        """Forward hooks on the first and last transformer layers of this stage."""
        layers = [m for m in model.modules() if type(m).__name__ == "TransformerLayer"]
        layers[-1].register_forward_hook(self._after_layer_forward)
        layers[0].register_forward_hook(self._watch_backward)

    def _after_layer_forward(self, module, args, output) -> None:
        for point, mb in (("forward", 1), ("forward-last", self.last_microbatch)):
            if self.armed(point, mb):
                self.send()

    def _watch_backward(self, module, args, output) -> None:
        for point, mb in (("backward", 0), ("backward-last", self.last_microbatch)):
            if self.armed(point, mb):
                hidden = output[0] if isinstance(output, tuple) else output
                hidden.register_hook(self._in_backward)

    def _in_backward(self, grad):
        self.send()
        return None

    def hook_optimizer(self) -> None:
        from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                           register_optimizer_step_pre_hook)

        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)

    def _before_step(self, optimizer, args, kwargs) -> None:
        self.optimizer_steps += 1
        if self.point == "optimizer" and self.optimizer_steps == self.iteration:
            self.send()

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self.point == "after-optimizer" and self.optimizer_steps == self.iteration:
            self.send()

    def hook_engine(self) -> None:
        """Wrap the posix engine's system calls (every engine of this process)."""
        from ssdtrain_megatron.io.posix import PosixEngine

        for point, name in (("write", "_pwrite"), ("read", "_pread")):
            if self.point == point:
                original = getattr(PosixEngine, name)
                setattr(PosixEngine, name, self._in_io(point, original))

    def _in_io(self, point: str, original):
        def io_with_preemption(engine, op, view):
            if self.armed(point) and self.send():
                self._hold_until_handled()
            return original(engine, op, view)

        return io_with_preemption

    @staticmethod
    def _hold_until_handled() -> None:
        from megatron.training.global_vars import get_signal_handler

        handler = get_signal_handler()
        deadline = time.monotonic() + HOLD_IO_S
        while not handler._signal_received and time.monotonic() < deadline:
            time.sleep(0.001)
