"""IO engines behind one interface (see base.IOEngine); ``make_engine`` picks one by name.

Importing this package imports no torch (``ssdtrain clean`` and ``--help`` use its modules):
the engine interface and the engines load when first asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..config import OffloadConfig

if TYPE_CHECKING:
    from .base import IOEngine
    from .layout import Identity

__all__ = ["EngineError", "EngineUnavailable", "IOEngine", "Identity", "make_engine", "engine_class"]


def engine_class(name: str) -> type:
    """The engine class called ``name``; imported only when asked for (aio and gds pull in
    DeepSpeed and kvikio, and only when constructed)."""
    if name == "posix":
        from .posix import PosixEngine

        return PosixEngine
    if name == "aio":
        from .aio import AioEngine

        return AioEngine
    if name == "gds":
        from .gds import GdsEngine

        return GdsEngine
    if name == "memory":
        from .memory import MemoryEngine

        return MemoryEngine
    if name == "tiered":
        from .tiered import TieredEngine

        return TieredEngine
    from .base import EngineUnavailable

    raise EngineUnavailable(f"unknown engine {name!r}; available: posix, aio, gds, memory, tiered")


def make_engine(config: OffloadConfig, ident: Optional[Identity] = None) -> IOEngine:
    """Build the engine named by ``config.engine``, after checking it can run here."""
    cls = engine_class(config.engine)
    ok, why = cls.is_available()
    if not ok:
        from .base import EngineUnavailable

        raise EngineUnavailable(f"engine {config.engine!r} cannot run here: {why}")
    from .affinity import check_cpus

    check_cpus(config.io_cpus)  # before any IO thread starts
    engine = cls(config, ident)
    # The cap emulates a slower drive: tiered applies it to its SSD tier itself (io/tiered.py).
    if config.bandwidth_cap_gbps is not None and config.engine != "tiered":
        from .throttle import ThrottledEngine

        try:
            engine = ThrottledEngine(engine, config.bandwidth_cap_gbps, config.io_cpus)
        except BaseException:
            engine.close()  # a failed start leaves nothing on disk
            raise
    return engine


def __getattr__(name: str):  # the interface loads on first use (it imports torch)
    if name in ("EngineError", "EngineUnavailable", "IOEngine"):
        from . import base

        return getattr(base, name)
    if name == "Identity":
        from .layout import Identity

        return Identity
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
