"""The tests' name for the package's CPU runtime for megatron-core (ssdtrain_megatron.megatron.cpu)."""

from ssdtrain_megatron.megatron.cpu import *  # noqa: F401,F403
from ssdtrain_megatron.megatron.cpu import CpuDeviceMode, disable, enable, enabled, is_enabled  # noqa: F401
