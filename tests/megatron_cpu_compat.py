"""The tests' name for the package's CPU runtime for megatron-core (ssdtrain_megatron.megatron.cpu)."""

from ssdtrain_megatron.megatron.cpu import CpuDeviceMode, disable, enable, enabled, is_enabled

__all__ = ["CpuDeviceMode", "disable", "enable", "enabled", "is_enabled"]
