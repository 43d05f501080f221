"""SSD activation offloading for Megatron training (see README.md and docs/).

Where things live, top to bottom (imports go only downwards): ``tools/`` (the ``ssdtrain``
command, demo and benchmarks; never imported by the library) -> ``megatron/`` (``install()``,
the ``--ssd-offload-*`` flags) -> ``cache/`` (``ActivationOffloader``) -> ``io/`` (engines),
``plan/``, ``telemetry/`` -> ``config.py`` (``OffloadConfig``, where every flag lands).
"""

from .config import ConfigError, OffloadConfig

__version__ = "0.1.0"

__all__ = ["ActivationOffloader", "ConfigError", "OffloadConfig", "StepStats", "__version__"]


def __getattr__(name):  # lazy: importing the package must not import torch
    if name == "ActivationOffloader":
        from .cache import ActivationOffloader

        return ActivationOffloader
    if name == "StepStats":
        from .telemetry.stats import StepStats

        return StepStats
    raise AttributeError(name)
