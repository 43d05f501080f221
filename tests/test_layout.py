"""On-disk layout: templates, per-rank directories, the extent allocator, striping."""

import os
import random
import stat

import pytest
import torch

from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.io.extents import ExtentAllocator
from ssdtrain_megatron.io.layout import Identity, LayoutError, expand_root, make_rank_dir, remove_rank_dir
from ssdtrain_megatron.io.posix import PosixEngine
from tests.drives import mount

IDENT = Identity(rank=3, local_rank=1, hostname="node7", job="j42")


def test_templates_expand_per_rank():
    assert expand_root("/mnt/nvme{local_rank}/{job}/{hostname}/r{rank}", IDENT) == "/mnt/nvme1/j42/node7/r3"


def test_user_expands_to_the_login_name_the_job_runs_as():
    """{user} (issue 65): a folder per user on a shared drive. Broken on main: an unknown
    placeholder (the config refused it; expand_root raised KeyError)."""
    import pwd

    me = pwd.getpwuid(os.getuid()).pw_name
    assert IDENT.user == me
    assert expand_root("/raid/{user}/ssdtrain/{local_rank}/{job}", IDENT) == f"/raid/{me}/ssdtrain/1/j42"
    alice = Identity(rank=0, local_rank=0, hostname="h", job="7", user="alice")
    assert expand_root("/raid/{user}/{job}", alice) == "/raid/alice/7"
    assert OffloadConfig(dirs=["/raid/{user}/{job}"], stats_path="/out/{user}/s-{rank}.jsonl").dirs == [
        "/raid/{user}/{job}"]
    with pytest.raises(LayoutError, match=r"\{user\}='\.\.' cannot be used in the offload path"):
        expand_root("/raid/{user}/{job}", Identity(rank=0, local_rank=0, hostname="h", job="7", user=".."))


def test_rank_identity_comes_from_launcher_env(monkeypatch):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ident = Identity.detect("j")
    assert (ident.rank, ident.local_rank) == (5, 1)
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("LOCAL_RANK")
    assert (Identity.detect("j").rank, Identity.detect("j").local_rank) == (0, 0)


def test_rank_dir_is_private_and_removed(tmp_path):
    d = make_rank_dir(str(tmp_path / "root"), IDENT)
    assert os.path.basename(d) == f"ssdtrain.j42.node7.rank3.pid{os.getpid()}"
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(os.path.join(d, "owner.json")).st_mode) == 0o600
    remove_rank_dir(d)
    assert os.listdir(tmp_path / "root") == []


def test_symlink_in_place_of_rank_dir_is_refused(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    target = tmp_path / "elsewhere"
    target.mkdir()
    os.symlink(target, root / f"ssdtrain.j42.node7.rank3.pid{os.getpid()}")
    with pytest.raises(LayoutError, match="already exists"):
        make_rank_dir(str(root), IDENT)
    assert os.listdir(target) == []


def test_world_writable_root_without_sticky_bit_is_refused(tmp_path):
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)
    with pytest.raises(LayoutError, match="world-writable without the sticky bit"):
        make_rank_dir(str(root), IDENT)
    os.chmod(root, 0o1777)
    remove_rank_dir(make_rank_dir(str(root), IDENT))


def test_extent_allocator_reuses_and_coalesces():
    a = ExtentAllocator()
    x, y, z = a.allocate(5000), a.allocate(4096), a.allocate(1)
    assert (x, y, z) == (0, 8192, 12288) and a.size == 16384 and a.allocated == 16384
    a.free(x, 5000)
    a.free(y, 4096)  # coalesces with x's extent
    assert a.allocate(12288) == 0  # fits in the merged hole
    a.free(0, 12288)
    a.free(z, 1)
    assert a.allocated == 0
    assert a.allocate(16384) == 0 and a.size == 16384


def test_extent_allocator_random_workload_never_overlaps():
    rng = random.Random(0)
    a = ExtentAllocator()
    live = {}
    for _ in range(2000):
        if live and rng.random() < 0.45:
            start = rng.choice(list(live))
            a.free(start, live.pop(start))
        else:
            n = rng.randint(1, 50_000)
            start = a.allocate(n)
            live[start] = n
        spans = sorted((s, s + (n + 4095) // 4096 * 4096) for s, n in live.items())
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        assert a.allocated == sum(e - s for s, e in spans)


def test_a_free_noted_for_later_gives_the_layout_an_immediate_free_gives():
    """The training thread's free (``free_later``) is applied by the next allocation: every
    allocation sees the same free extents as with ``free``, so both lay out alike."""
    rng = random.Random(1)
    now, later = ExtentAllocator(), ExtentAllocator()
    live = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            start = rng.choice(list(live))
            n = live.pop(start)
            now.free(start, n)
            later.free_later(start, n)
        else:
            n = rng.randint(1, 50_000)
            start = now.allocate(n)
            assert later.allocate(n) == start
            live[start] = n
        if rng.random() < 0.1:
            assert later.allocated == now.allocated
    assert (later.size, later.allocated) == (now.size, now.allocated)


def test_a_free_noted_for_later_is_reused_by_the_next_allocation():
    a = ExtentAllocator()
    x = a.allocate(8192)
    a.allocate(4096)
    a.free_later(x, 8192)
    assert a.allocate(8192) == x and a.size == 12288  # the hole, not the slab's end
    a.free_later(x, 8192)
    assert a.allocated == 4096  # counted as free once looked at
    a.reset()
    assert a.allocate(4096) == 0 and a.allocated == 4096  # nothing noted survives a reset


def test_striping_puts_chunks_on_every_root(tmp_path):
    roots = mount(*(tmp_path / f"nvme{i}" for i in range(3)))
    eng = PosixEngine(OffloadConfig(dirs=roots, chunk_bytes=4096))
    try:
        data = torch.arange(10_000, dtype=torch.int32)
        eng.write(0, data.view(torch.uint8)).result()
        sizes = [os.path.getsize(os.path.join(d, "slab.bin")) for d in eng.rank_dirs]
        assert all(s > 0 for s in sizes)
        out = torch.empty_like(data)
        eng.read(0, out.view(torch.uint8)).result()
        assert torch.equal(out, data)
        assert eng.page_cache_bypassed  # ext4 under /tmp and /work accepts O_DIRECT
        eng.release(0)
        assert eng.bytes_on_disk == 0
    finally:
        eng.close()
    assert all(os.listdir(r) == [] for r in roots)


def test_two_templates_for_one_root_are_refused(tmp_path):
    with pytest.raises(RuntimeError, match=r"dirs\[1\] expands to .* same root as dirs\[0\]"):
        PosixEngine(OffloadConfig(dirs=[str(tmp_path), str(tmp_path) + "/"]))
