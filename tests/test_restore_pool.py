"""On a CPU device, restored tensors reuse host memory earlier restores had (cache/restore_pool.py).

Real torch storages and mappings; the offloader tests train a real model on the posix engine
(real slab files) and compare losses and gradients with keep's as integer views."""

from __future__ import annotations

import gc
import mmap
import os

import pytest
import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.cache import restore_pool
from ssdtrain_megatron.cache.restore_pool import HUGE_PAGE, MIN_POOLED_BYTES, PAGE, RestorePool
from tests.models import assert_bitwise_equal, run_steps, tiny_gpt
from tests.test_offloader import gpt_batches


def test_a_block_is_reused_only_once_every_view_of_its_tensor_is_gone():
    """Broken variant: ``_collect`` taking every lent block back without ``_expired``: the
    second request gets the block the live view still uses, and this fails."""
    pool = RestorePool(1 << 30, min_bytes=1)
    t = pool.empty(100_000, torch.float32)
    addr = t.data_ptr()
    assert addr % PAGE == 0
    view = t[10:20]
    del t
    other = pool.empty(100_000, torch.float32)  # the view still uses the first block
    assert other.data_ptr() != addr and pool.reused == 0
    del view
    gc.collect()
    again = pool.empty(100_000, torch.float32)
    assert again.data_ptr() == addr and pool.reused == 1


def test_every_tensor_gets_its_own_storage_object():
    """Identity (identity.py) goes by storage: a reused block must come as a new storage, or a
    later save could match a record of the tensor that had the block before. (The weak
    reference keeps the first storage object's address from being reused.) Broken variant:
    blocks kept as tensors and handed out as views of them: one storage, and this fails."""
    pool = RestorePool(1 << 30, min_bytes=1)
    a = pool.empty(4096, torch.uint8)
    first = a.untyped_storage()._cdata
    ref = a.untyped_storage()._weak_ref()
    del a
    b = pool.empty(4096, torch.uint8)
    assert pool.reused == 1
    assert torch.UntypedStorage._expired(ref)
    assert b.untyped_storage()._cdata != first
    torch.UntypedStorage._free_weak_ref(ref)


def test_past_its_capacity_the_pool_gives_allocator_memory_and_unmaps_free_blocks():
    pool = RestorePool(3 * PAGE, min_bytes=1)
    a = pool.empty(2 * PAGE, torch.uint8)
    b = pool.empty(2 * PAGE, torch.uint8)  # does not fit while `a` lives: torch.empty
    assert pool.outside == 1 and pool.mapped_bytes == 2 * PAGE
    del a, b
    c = pool.empty(3 * PAGE, torch.uint8)  # the free 2-page block is unmapped to make room
    assert pool.mapped_bytes == 3 * PAGE and pool.mapped == 2
    c.fill_(7)
    pool.close()
    assert int(c.sum()) == 7 * 3 * PAGE  # memory handed out stays valid after close()


def test_small_tensors_take_allocator_memory_and_large_ones_are_pooled():
    """Below MIN_POOLED_BYTES the C allocator's heap reuses memory already; pooling 10,000 small
    tensors a step made each restore scan every lent block of its size (tests/test_soak.py
    measured milliseconds per tensor). Broken variant: the threshold check removed: mapped 1."""
    pool = RestorePool(1 << 30)
    small = pool.empty(1024, torch.float32)
    assert pool.mapped == 0 and pool.outside == 0 and small.numel() == 1024
    big = pool.empty(MIN_POOLED_BYTES // 4, torch.float32)
    assert pool.mapped == 1 and big.data_ptr() % PAGE == 0


def test_offloaded_training_reads_back_into_reused_memory_bitwise_equal(offload_dir, monkeypatch):
    """From the second step on, every restore reuses memory (no fresh pages), the bytes still
    come back from the engine, and losses and gradients equal keep's bitwise.
    Broken variant: ``RestorePool.empty`` returning ``torch.empty`` always: ``reused`` stays 0."""
    monkeypatch.setattr(restore_pool, "MIN_POOLED_BYTES", 1)  # this model's tensors are small
    model = tiny_gpt()
    batches = gpt_batches()
    ref = run_steps(model, batches, steps=3)
    with ActivationOffloader(OffloadConfig(dirs=[str(offload_dir)], min_tensor_bytes=1024)) as off:
        got = run_steps(model, batches, off, steps=3, wait_writes=True)
        pool = off.transfers.restore_pool
        assert pool.reused > 0 and pool.outside == 0
        assert pool.mapped_bytes <= off.config.max_inflight_bytes
    assert_bitwise_equal(ref, got)
    for st in got[2]:
        assert st.bytes_read > 0


def _vma_of(addr: int) -> tuple:
    """(permissions, VmFlags) of the mapping of this process that holds ``addr``."""
    perms, flags, inside = None, None, False
    with open("/proc/self/smaps", encoding="ascii") as fh:
        for line in fh:
            head = line.split()
            if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                inside = lo <= addr < hi
                if inside:
                    perms = head[1]
            elif inside and line.startswith("VmFlags:"):
                flags = line.split()[1:]
                break
    return perms, flags


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps") or not hasattr(mmap, "MADV_HUGEPAGE"),
                    reason="needs Linux /proc/self/smaps and MADV_HUGEPAGE")
def test_blocks_are_private_and_advised_for_huge_pages_from_2_mib():
    """A block is private (a forked data-loader worker gets copy-on-write pages, not ours) and,
    from 2 MiB, advised for transparent huge pages (VmFlags ``hg``): each O_DIRECT read then
    pins 2 MiB pages instead of 512 small ones. Smaller blocks are not advised.
    Broken variants: ``mmap.mmap(-1, size)`` (shared): perms ``rw-s``; the madvise removed:
    no ``hg``."""
    pool = RestorePool(1 << 30, min_bytes=1)
    big = pool.empty(HUGE_PAGE, torch.uint8)
    small = pool.empty(HUGE_PAGE // 2, torch.uint8)
    perms, flags = _vma_of(big.data_ptr())
    if flags is None:
        pytest.skip("this kernel's smaps has no VmFlags line")
    assert perms == "rw-p" and "hg" in flags, (perms, flags)
    perms, flags = _vma_of(small.data_ptr())
    assert perms == "rw-p" and "hg" not in flags, (perms, flags)
