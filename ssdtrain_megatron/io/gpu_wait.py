"""How an IO thread waits for a CUDA event before it touches the memory the event guards.

Why: the first CUDA runtime call a thread makes binds it to its *current* device, which for a
new thread is device 0, and creates device 0's context in this process if it has none: on a
node with 8 GPUs every rank's IO threads would each put a context (hundreds of MiB) on GPU 0.
So the event's own device is made current first (``torch.cuda.set_device`` is a no-op when
it already is). The events the offloader hands over are created with blocking sync
(cache/stream_ops.py), so the wait sleeps instead of spinning a core.

Events without a CUDA ``device`` (the tests' stand-ins) are just waited for.
"""

from __future__ import annotations

from typing import Any

import torch


def wait_for(event: Any) -> None:
    """Block the calling (IO) thread until ``event`` completed, on the event's device."""
    device = getattr(event, "device", None)
    if device is not None and getattr(device, "type", None) == "cuda":
        torch.cuda.set_device(device)
    event.synchronize()
