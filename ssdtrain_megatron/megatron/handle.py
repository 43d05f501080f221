"""The one installed offloader of the process, whichever integration installed it.

``install()`` of megatron-core (install.py) and of DeepSpeed (deepspeed.py) both patch
process-wide classes and the checkpoint function, and both own one ActivationOffloader; two at
once would wrap every layer twice and offload each activation into two caches. So there is one
slot, here: installing while either integration is installed is a RuntimeError that names the
one to uninstall first. This is the only module-level mutable state of the package besides the
exit/signal cleaners of io/cleanup.py.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

MODULES = {"megatron-core": "ssdtrain_megatron.megatron", "deepspeed": "ssdtrain_megatron.megatron.deepspeed"}
"""Each integration and the module whose install()/uninstall() it is."""

_INSTALLED: Optional[Tuple[str, Any]] = None  # (integration, its Installation)


def installed(integration: Optional[str] = None) -> Optional[Any]:
    """The installation of ``integration`` (default: of either), or None."""
    if _INSTALLED is None or (integration is not None and _INSTALLED[0] != integration):
        return None
    return _INSTALLED[1]


def check_free(integration: str) -> None:
    """Raise RuntimeError unless nothing is installed."""
    if _INSTALLED is None:
        return
    current = MODULES[_INSTALLED[0]]
    if _INSTALLED[0] == integration:
        raise RuntimeError(f"{current}.install() was already called; call uninstall() before "
                           "installing again")
    raise RuntimeError(
        f"{current}.install() is active in this process: one process offloads through "
        f"megatron-core or DeepSpeed, not both (each patches layers and checkpointing). Call "
        f"{current}.uninstall() before {MODULES[integration]}.install()")


def claim(integration: str, installation: Any) -> None:
    """Make ``installation`` the process's one (after :func:`check_free`)."""
    global _INSTALLED
    check_free(integration)
    _INSTALLED = (integration, installation)


def release(integration: str) -> Optional[Any]:
    """Empty the slot if ``integration`` holds it; its installation (to undo), or None."""
    global _INSTALLED
    if _INSTALLED is None or _INSTALLED[0] != integration:
        return None
    inst, _INSTALLED = _INSTALLED[1], None
    return inst
