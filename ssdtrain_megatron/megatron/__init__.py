"""Megatron integration: ``install(config)`` patches megatron-core 0.16.x-0.19.x so its training
steps offload activations; ``uninstall()`` restores it. The only part of the library that imports
megatron (lazily: importing this package does not); ``args.py`` turns the ``--ssd-offload-*``
flags into an ``OffloadConfig``, which ``install()`` hands to an ``ActivationOffloader`` (cache/).

Example:
    >>> from ssdtrain_megatron import OffloadConfig
    >>> from ssdtrain_megatron.megatron import install, uninstall
    >>> offloader = install(OffloadConfig(dirs=["/mnt/nvme0/ssdtrain/{job}"]))
    >>> ...  # the usual megatron training loop, unchanged
    >>> uninstall()
"""

from .install import (
    SUPPORTED_MEGATRON_CORE,
    UnsupportedMegatronVersion,
    check_megatron_version,
    install,
    megatron_core_version,
    installed,
    uninstall,
)

__all__ = [
    "SUPPORTED_MEGATRON_CORE",
    "UnsupportedMegatronVersion",
    "check_megatron_version",
    "install",
    "megatron_core_version",
    "installed",
    "uninstall",
]
