"""FaultyEngine for tests: the wrapper lives in ``ssdtrain_megatron.tools.faults`` (``ssdtrain
soak`` injects faults through it too); this module keeps the tests' imports working."""

from ssdtrain_megatron.tools.faults import SHORT, Fault, FaultyEngine, faulty_offloader  # noqa: F401


class HeldWrites:
    """A fault hook (``engine.fault``) that holds the IO thread inside the first write after
    ``held`` is set, until ``go`` is set; ``entered`` says it is held."""

    def __init__(self) -> None:
        import threading

        self.held, self.entered, self.go = False, threading.Event(), threading.Event()

    def __call__(self, op, path, offset, nbytes):
        if op == "write" and self.held and not self.go.is_set():
            self.entered.set()
            self.go.wait(60)
        return None

