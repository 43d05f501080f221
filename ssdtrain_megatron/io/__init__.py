"""IO engines behind one interface (see base.IOEngine); ``make_engine`` picks one by name."""

from __future__ import annotations

from typing import Optional

from ..config import OffloadConfig
from .base import EngineError, EngineUnavailable, IOEngine
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
    raise EngineUnavailable(f"unknown engine {name!r}; available: posix, aio, gds, memory, tiered")


def make_engine(config: OffloadConfig, ident: Optional[Identity] = None) -> IOEngine:
    """Build the engine named by ``config.engine``, after checking it can run here."""
    cls = engine_class(config.engine)
    ok, why = cls.is_available()
    if not ok:
        raise EngineUnavailable(f"engine {config.engine!r} cannot run here: {why}")
    engine = cls(config, ident)
    if config.bandwidth_cap_gbps is not None:
        from .throttle import ThrottledEngine

        try:
            engine = ThrottledEngine(engine, config.bandwidth_cap_gbps)
        except BaseException:
            engine.close()  # a failed start leaves nothing on disk
            raise
    return engine
