"""The activation cache: saved-tensor hooks, records, dedup, prefetch, forwarding.

``ActivationOffloader`` reads its ``OffloadConfig`` (keep/offload/recompute per layer, prefetch
window, bytes in flight) and hands each tensor it offloads to the IO engine that
``io.make_engine`` built. Nothing here imports megatron: ``megatron/`` drives it."""

from .offloader import ActivationOffloader, IOTimeout

__all__ = ["ActivationOffloader", "IOTimeout"]
