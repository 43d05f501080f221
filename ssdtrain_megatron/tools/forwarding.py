"""ForwardingEngine: the base of every wrapper around a real engine (tools/faults.py's
FaultyEngine, which ``ssdtrain soak`` and the tests use; the device-copy tests' LoggedEngine).

A wrapper that only defines ``__getattr__`` is not transparent: :class:`IOEngine` declares
``completions``, ``cancel``, the meters, ``ident``, ``rank_dirs``, ``step_peak_bytes`` and
``tracer`` with class defaults, so reads of them stop at the wrapper (``__getattr__`` never
runs) and the offloader's ``engine.completions = queue`` lands on the wrapper. The real engine
then keeps returning Futures and the test runs the offloader's fallback relay instead of its
completion queue, ``cancel`` always says False and the meters read zero. Here every name
IOEngine declares is forwarded explicitly, and every attribute set on the wrapper goes to the
inner engine (except the wrapper's own, listed in ``_own``). ``tests/test_device_copy.py``
checks that no name IOEngine declares is left out.
"""

from __future__ import annotations

from typing import Tuple

from ssdtrain_megatron.io.base import IOEngine


def _forward(name: str) -> property:
    return property(lambda self: getattr(self.inner, name),
                    lambda self, value: setattr(self.inner, name, value))


class ForwardingEngine(IOEngine):
    """``inner`` as it is; subclasses override the calls they watch or change."""

    _own: Tuple[str, ...] = ()
    """Attributes that belong to the wrapper; every other one set on it is the inner engine's."""

    def __init__(self, inner: IOEngine) -> None:
        object.__setattr__(self, "inner", inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):
        if name in self._own:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    # IOEngine declares these with defaults, so __getattr__ never sees them: forward each.
    name = _forward("name")
    tier = _forward("tier")
    completions = _forward("completions")
    device_direct = _forward("device_direct")
    ident = _forward("ident")
    rank_dirs = _forward("rank_dirs")
    step_peak_bytes = _forward("step_peak_bytes")
    tracer = _forward("tracer")
    write_meter = _forward("write_meter")
    read_meter = _forward("read_meter")
    bytes_on_disk = _forward("bytes_on_disk")

    def write(self, key, data, ready_event=None):
        return self.inner.write(key, data, ready_event)

    def read(self, key, out, ready_event=None):
        return self.inner.read(key, out, ready_event)

    def release(self, key):
        self.inner.release(key)

    def cancel(self, key):
        return self.inner.cancel(key)

    def place(self, key, tier):
        self.inner.place(key, tier)

    def tier_meters(self):
        return self.inner.tier_meters()

    def pool_view(self, key, nbytes):
        return self.inner.pool_view(key, nbytes)

    def pool_view_of(self, key):
        return self.inner.pool_view_of(key)

    def commit(self, key):
        self.inner.commit(key)

    def pool_read(self, key, started):
        self.inner.pool_read(key, started)

    def fence(self, key, event):
        self.inner.fence(key, event)

    def end_step(self):
        self.inner.end_step()

    def close(self):
        self.inner.close()

    def remove_files(self):
        self.inner.remove_files()
