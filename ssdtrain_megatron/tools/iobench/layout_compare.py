"""``ssdtrain io-bench --compare-layout``: one slab with extents against one file per tensor,
same threads and request size, no engine (why the engines keep tensors in one slab)."""

from __future__ import annotations

import os
import time
from typing import Dict

from ...io.layout import align_up
from .measure import GB, _Blocks, _buffers, _do, _open_direct, _run_threads


def layout_compare(directory: str, n_tensors: int, tensor_bytes: int, threads: int,
                   chunk: int) -> Dict[str, Dict[str, float]]:
    """Tensors in one preallocated slab vs one new file per tensor: same threads, same request
    size (``min(chunk, tensor)``), O_DIRECT, each thread writing/reading whole tensors."""
    req = min(chunk, align_up(tensor_bytes))
    padded = align_up(tensor_bytes, req)
    total = n_tensors * padded
    bufs = _buffers(threads, req)
    results: Dict[str, Dict[str, float]] = {}
    try:
        # Slab: one file, preallocated (the fallocate is timed with the writes).
        path = os.path.join(directory, "layout-slab.bin")
        fd, _ = _open_direct(path)
        try:
            res: Dict[str, float] = {}
            for op in ("write", "read"):
                work = _Blocks([(i, i * padded, 0) for i in range(n_tensors)])

                def slab_worker(t: int, op: str = op, work: _Blocks = work) -> None:
                    with memoryview(bufs[t]) as mv:
                        while (item := work.take()) is not None:
                            for off in range(item[1], item[1] + padded, req):
                                _do(op, fd, mv, off, path)

                t0 = time.perf_counter()
                if op == "write":
                    os.posix_fallocate(fd, 0, total)
                _run_threads(threads, slab_worker)
                res[f"{op}_gbps"] = n_tensors * tensor_bytes / (time.perf_counter() - t0) / GB
            results["slab"] = res
        finally:
            os.close(fd)
            os.unlink(path)

        # One file per tensor, created by the write (what per-tensor torch.save does).
        names = [os.path.join(directory, f"layout-file-{i}.bin") for i in range(n_tensors)]
        res = {}
        for op in ("write", "read"):
            work = _Blocks([(i, 0, 0) for i in range(n_tensors)])

            def file_worker(t: int, op: str = op, work: _Blocks = work) -> None:
                with memoryview(bufs[t]) as mv:
                    while (item := work.take()) is not None:
                        name = names[item[0]]
                        if op == "write":
                            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
                        else:
                            fd = os.open(name, os.O_RDONLY | os.O_DIRECT)
                        try:
                            for off in range(0, padded, req):
                                _do(op, fd, mv, off, name)
                        finally:
                            os.close(fd)

            res[f"{op}_gbps"] = n_tensors * tensor_bytes / _run_threads(threads, file_worker) / GB
        t0 = time.perf_counter()
        for name in names:
            os.unlink(name)
        res["unlink_us_per_file"] = (time.perf_counter() - t0) / n_tensors * 1e6
        results["file_per_tensor"] = res
        return results
    finally:
        for name in os.listdir(directory):
            if name.startswith("layout-"):
                os.unlink(os.path.join(directory, name))
        for b in bufs:
            b.close()
