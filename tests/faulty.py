"""FaultyEngine: fault injection for tests, through a wrapper engine (production engines carry
no test hook).

It wraps a disk engine (posix, aio, gds, or tiered: then its SSD tier) and puts a faulty
:class:`~ssdtrain_megatron.io.syscalls.SysCalls` in front of the engine's own, so each fault
runs the engine's real error path on its IO thread. ``engine.fault`` (settable at any time) is
called as ``fault(op, path, offset, nbytes)`` once per call the engine makes ("write"/"read";
the file; the call's byte range, which for a merged run of chunks spans all of them); it may
block (a gate holding an IO thread) and returns None, or an OSError for the call to fail with:

- posix: raised by pwritev/preadv, as the kernel's error would be;
- aio: DeepNVMe's handle makes its system calls in C, so the fault is what the engine sees of
  them: the submission refused with the negative errno as its return code;
- gds: raised by the kvikio call.

It lives in tests/ because nothing but tests needs it (ThrottledEngine, by contrast, serves
what-if runs too).
"""

from __future__ import annotations

from typing import Callable, Optional

from ssdtrain_megatron.io.base import IOEngine
from ssdtrain_megatron.io.syscalls import SysCalls

Fault = Callable[[str, str, int, int], Optional[OSError]]


def _size(buffers) -> int:
    return sum(memoryview(b).nbytes for b in buffers)


class _FaultyCalls(SysCalls):
    def __init__(self, owner: "FaultyEngine", real: SysCalls) -> None:
        self.owner, self.real = owner, real

    def _check(self, op: str, path: str, offset: int, nbytes: int) -> Optional[OSError]:
        fault = self.owner.fault
        return fault(op, path, offset, nbytes) if fault is not None else None

    def pwritev(self, fd, buffers, offset, path):
        err = self._check("write", path, offset, _size(buffers))
        if err is not None:
            raise err
        return self.real.pwritev(fd, buffers, offset, path)

    def preadv(self, fd, buffers, offset, path):
        err = self._check("read", path, offset, _size(buffers))
        if err is not None:
            raise err
        return self.real.preadv(fd, buffers, offset, path)

    def aio_submit(self, handle, writing, stage, fd, path, offset):
        err = self._check("write" if writing else "read", path, offset, stage.numel() * stage.element_size())
        if err is not None:
            return -(err.errno or 5)
        return self.real.aio_submit(handle, writing, stage, fd, path, offset)

    def aio_wait(self, handle):
        return self.real.aio_wait(handle)

    def gds_submit(self, handle, writing, buf, nbytes, offset, path):
        err = self._check("write" if writing else "read", path, offset, nbytes)
        if err is not None:
            raise err
        return self.real.gds_submit(handle, writing, buf, nbytes, offset, path)


class FaultyEngine(IOEngine):
    """``inner`` with ``fault`` injected into its calls; everything else is the inner engine's."""

    def __init__(self, inner: IOEngine, fault: Optional[Fault] = None) -> None:
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "fault", fault)
        disk = getattr(inner, "ssd", inner)  # tiered: the SSD tier does the IO
        object.__setattr__(self, "_disk", disk)
        disk._sys = _FaultyCalls(self, disk._sys)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __setattr__(self, name, value):  # everything but the hook is the inner engine's
        if name == "fault":
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    # IOEngine declares these with defaults, so __getattr__ never sees them: forward each.
    name = property(lambda self: self.inner.name)
    completions = property(lambda self: self.inner.completions)
    device_direct = property(lambda self: self.inner.device_direct)
    ident = property(lambda self: self.inner.ident)
    rank_dirs = property(lambda self: self.inner.rank_dirs)
    step_peak_bytes = property(lambda self: self.inner.step_peak_bytes)
    tracer = property(lambda self: self.inner.tracer)
    write_meter = property(lambda self: self.inner.write_meter)
    read_meter = property(lambda self: self.inner.read_meter)
    bytes_on_disk = property(lambda self: self.inner.bytes_on_disk)

    def write(self, key, data, ready_event=None):
        return self.inner.write(key, data, ready_event)

    def read(self, key, out, ready_event=None):
        return self.inner.read(key, out, ready_event)

    def release(self, key):
        self.inner.release(key)

    def cancel(self, key):
        return self.inner.cancel(key)

    def pool_view(self, key, nbytes):
        return self.inner.pool_view(key, nbytes)

    def pool_view_of(self, key):
        return self.inner.pool_view_of(key)

    def fence(self, key, event):
        self.inner.fence(key, event)

    def end_step(self):
        self.inner.end_step()

    def close(self):
        self.inner.close()

    def remove_files(self):
        self.inner.remove_files()


def faulty_offloader(config, fault: Optional[Fault] = None, **kwargs):
    """An ActivationOffloader on ``config``'s engine wrapped in a FaultyEngine (``off.engine``)."""
    from ssdtrain_megatron import ActivationOffloader
    from ssdtrain_megatron.io import make_engine

    return ActivationOffloader(config, engine=FaultyEngine(make_engine(config), fault), **kwargs)
