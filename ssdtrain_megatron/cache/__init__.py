"""The activation cache: saved-tensor hooks, records, dedup, prefetch, forwarding."""

from .offloader import ActivationOffloader, IOTimeout

__all__ = ["ActivationOffloader", "IOTimeout"]
