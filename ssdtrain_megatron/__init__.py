"""SSD activation offloading for Megatron training (see README.md and DESIGN.md)."""

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
