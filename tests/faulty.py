"""FaultyEngine for tests: the wrapper lives in ``ssdtrain_megatron.tools.faults`` (``ssdtrain
soak`` injects faults through it too); this module keeps the tests' imports working."""

from ssdtrain_megatron.tools.faults import SHORT, Fault, FaultyEngine, faulty_offloader  # noqa: F401
