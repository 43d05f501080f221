"""ForwardingEngine lives in ``ssdtrain_megatron.tools.forwarding`` (``ssdtrain soak``'s fault
wrapper is built on it); this module keeps the tests' imports working."""

from ssdtrain_megatron.tools.forwarding import ForwardingEngine  # noqa: F401
