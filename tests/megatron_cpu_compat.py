"""The tests' name for the package's CPU runtime for megatron-core (ssdtrain_megatron.tools.megatron_cpu)."""

from ssdtrain_megatron.tools.megatron_cpu import CpuDeviceMode, disable, enable, enabled, is_enabled

__all__ = ["CpuDeviceMode", "disable", "enable", "enabled", "is_enabled"]
