"""OffloadConfig: the one object that flags, YAML presets and the Python API all produce.

Every field is typed, defaulted and documented right under it. ``__post_init__`` validates
everything, so a bad value fails before training starts, in one line that names the field,
the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import os
import string
from dataclasses import dataclass, field
from typing import Any, Optional

ENGINES = ("posix", "aio", "gds", "memory", "tiered")
POLICIES = ("offload", "adaptive", "keep")
TEMPLATE_KEYS = ("rank", "local_rank", "hostname", "job")


class ConfigError(ValueError):
    """An invalid OffloadConfig field; the message names the field, the value and what is allowed."""


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"OffloadConfig.{name}={value!r} is invalid: {allowed}")


def _check_template(index: int, template: Any, name: Optional[str] = None) -> None:
    name = name or f"dirs[{index}]"
    if not isinstance(template, str) or not template.strip():
        _fail(name, template, "expected a non-empty path string")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        _fail(name, template, f"not a valid path template ({exc})")
    for f in fields:
        if f not in TEMPLATE_KEYS:
            _fail(name, template, f"unknown placeholder {{{f}}}; allowed: "
                  + ", ".join("{%s}" % k for k in TEMPLATE_KEYS))
    if ".." in template.replace("\\", "/").split("/"):
        _fail(name, template, "'..' is not allowed in the path")
    if "\x00" in template:
        _fail(name, template, "NUL byte in path")


@dataclass
class OffloadConfig:
    """Settings of the SSD activation offloader.

    Example:
        >>> cfg = OffloadConfig(dirs=["/mnt/nvme0/ssdtrain/{job}", "/mnt/nvme1/ssdtrain/{job}"])
        >>> cfg.policy
        'offload'
    """

    dirs: list = field(default_factory=lambda: ["/tmp/ssdtrain"])
    """Offload roots, one per drive; tensors are striped across them. Path templates may use
    {rank}, {local_rank}, {hostname} and {job}. Each rank creates its own 0700 directory under
    every root and removes it when it closes, with the job folders (from the first component
    holding {job} on) that this leaves empty."""

    engine: str = "posix"
    """IO engine: 'posix' (thread pool, O_DIRECT; the default, no build step), 'aio' (DeepSpeed
    DeepNVMe aio_handle; needs libaio-dev and a one-time JIT build), 'gds' (kvikio/cuFile; CUDA
    only), 'memory' (host RAM pool of host_memory_bytes) or 'tiered' (host RAM up to
    host_memory_bytes, SSD beyond)."""

    policy: str = "offload"
    """'offload' writes every eligible activation to SSD; 'adaptive' lets the planner decide
    per layer; 'keep' installs the offloader but keeps everything in memory (the baseline)."""

    min_tensor_bytes: int = 256 * 1024
    """Saved tensors smaller than this stay in memory (IO per byte is too costly for them)."""

    keep_last_layers: int = 1
    """Per micro-batch, the last N annotated layers stay in memory when that micro-batch's
    backward follows its forward immediately (their backward starts right away)."""

    prefetch_layers: int = 2
    """During backward, how many layers ahead of the one being differentiated are read back."""

    max_inflight_bytes: int = 1 << 30
    """Cap on bytes being written at once; pack waits (and counts the wait) beyond it, so
    pending writes cannot pin unbounded memory."""

    pinned_staging_bytes: Optional[int] = None
    """GPU only: page-locked host memory allocated once, through which activations are copied
    between the GPU and the engine (writes and reads in flight share it). None: twice
    max_inflight_bytes. A copy that does not fit uses torch's pinned allocator (warned)."""

    checksum: bool = False
    """Store a CRC32C (io/checksum.py) of every written chunk and verify it on read (posix,
    aio and the SSD tier of tiered; refused with gds, which keeps no host copy to check, and
    with memory, which writes no file)."""

    stats_path: Optional[str] = None
    """When set, each step's StepStats is appended to this file as one JSON line. A path
    template like ``dirs`` ({rank}, ...): give each rank its own file. A restarted job (the
    same command line) appends to the same file; a directory there is refused at start."""

    io_threads: int = 4
    """Worker threads of the IO engine (each keeps one request in flight)."""

    chunk_bytes: int = 8 << 20
    """Tensors are written in chunks of at most this many bytes, striped over the roots;
    a multiple of 4096."""

    io_timeout_s: float = 300.0
    """Every wait on IO raises after this many seconds, naming what was pending."""

    trace_path: Optional[str] = None
    """Opt-in IO trace: one JSON line per IO request (time, rank, micro-batch, layer, phase, op,
    bytes, file offset, latency, queue depth), for `ssdtrain report`. A path template like
    ``dirs`` ({rank}, ...); give each rank its own file. Appended to, like ``stats_path``."""

    memory_budget_bytes: Optional[int] = None
    """Adaptive policy: activation bytes of one micro-batch allowed to stay in memory. None:
    as little as possible without stalling on IO."""

    activation_budget_bytes: Optional[float] = None
    """A hard cap on resident activation bytes (kept, being written, read back or read ahead):
    pack waits for writes, prefetch reads less, and adaptive plans within it. Bytes (flag: sizes
    like 12GiB), or on CUDA a fraction of the device's memory in (0, 1], e.g. 0.6. None: no cap.
    Not applied with policy 'keep' (the baseline writes nothing to make room with)."""

    recompute_fallback: bool = False
    """Layers that cannot be offloaded without stalling are recomputed instead (Megatron
    integration: they run under megatron's own tensor_parallel.checkpoint)."""

    recompute_layers: list = field(default_factory=list)
    """Static recompute plan: layer numbers (1-based, as Megatron numbers them) run under
    checkpointing instead of being offloaded, when recompute_fallback is on."""

    replan_io_wait_fraction: float = 0.05
    """Adaptive policy: re-plan when a step waits on IO for more than this fraction of it."""

    bandwidth_cap_gbps: Optional[float] = None
    """Cap on the engine's bandwidth in GB/s (reads and writes share it), emulating a slower
    drive: for tests and what-if runs. None: no cap."""

    job: Optional[str] = None
    """Job id for the {job} placeholder and directory names; default: SLURM_JOB_ID,
    TORCHELASTIC_RUN_ID, or 'local'."""

    host_memory_bytes: int = 4 << 30
    """Size of the host-memory pool of the 'memory' engine and of the memory tier of 'tiered'
    (pinned when CUDA exists, plain host memory otherwise). 'memory' fails a write that does
    not fit; 'tiered' sends it to SSD instead."""

    aio_block_bytes: int = 1 << 20
    """'aio' engine: bytes per libaio request; a multiple of 4096."""

    aio_queue_depth: int = 8
    """'aio' engine: libaio requests each aio thread keeps in flight."""

    aio_intra_op_parallelism: int = 1
    """'aio' engine: threads DeepNVMe splits each chunk across (every request is padded to a
    multiple of 4096 times this)."""

    def __post_init__(self) -> None:
        if isinstance(self.dirs, str):
            _fail("dirs", self.dirs, "expected a list of path templates, e.g. ['/mnt/nvme0/ssdtrain']")
        if not isinstance(self.dirs, (list, tuple)) or not self.dirs:
            _fail("dirs", self.dirs, "expected a non-empty list of path templates")
        self.dirs = list(self.dirs)
        for i, d in enumerate(self.dirs):
            _check_template(i, d)
        if self.engine not in ENGINES:
            _fail("engine", self.engine, "allowed: " + ", ".join(ENGINES))
        if self.policy not in POLICIES:
            _fail("policy", self.policy, "allowed: " + ", ".join(POLICIES))
        for name, minimum in (("min_tensor_bytes", 0), ("keep_last_layers", 0),
                              ("prefetch_layers", 1), ("max_inflight_bytes", 1),
                              ("io_threads", 1), ("chunk_bytes", 4096)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                _fail(name, value, f"expected an integer >= {minimum}")
        if self.pinned_staging_bytes is not None and (isinstance(self.pinned_staging_bytes, bool) or not isinstance(
                self.pinned_staging_bytes, int) or self.pinned_staging_bytes < 1):
            _fail("pinned_staging_bytes", self.pinned_staging_bytes, "expected an integer >= 1 or null")
        if self.chunk_bytes % 4096:
            _fail("chunk_bytes", self.chunk_bytes, "expected a multiple of 4096")
        if not isinstance(self.checksum, bool):
            _fail("checksum", self.checksum, "expected true or false")
        if self.stats_path is not None:
            if not isinstance(self.stats_path, str) or not self.stats_path:
                _fail("stats_path", self.stats_path, "expected a file path or null")
            _check_template(0, self.stats_path, "stats_path")
        if isinstance(self.io_timeout_s, bool) or not isinstance(self.io_timeout_s, (int, float)) \
                or not self.io_timeout_s > 0:
            _fail("io_timeout_s", self.io_timeout_s, "expected a number of seconds > 0")
        self.io_timeout_s = float(self.io_timeout_s)
        if self.trace_path is not None:
            if not isinstance(self.trace_path, str) or not self.trace_path:
                _fail("trace_path", self.trace_path, "expected a file path template or null")
            _check_template(0, self.trace_path, "trace_path")
        if self.memory_budget_bytes is not None and (isinstance(self.memory_budget_bytes, bool) or not isinstance(
                self.memory_budget_bytes, int) or self.memory_budget_bytes < 0):
            _fail("memory_budget_bytes", self.memory_budget_bytes, "expected an integer >= 0 or null")
        self._check_activation_budget()
        if not isinstance(self.recompute_fallback, bool):
            _fail("recompute_fallback", self.recompute_fallback, "expected true or false")
        if not isinstance(self.recompute_layers, (list, tuple)) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in self.recompute_layers):
            _fail("recompute_layers", self.recompute_layers, "expected a list of layer numbers >= 1")
        self.recompute_layers = list(self.recompute_layers)
        if isinstance(self.replan_io_wait_fraction, bool) or not isinstance(self.replan_io_wait_fraction, (int, float)) \
                or not 0 < self.replan_io_wait_fraction < 1:
            _fail("replan_io_wait_fraction", self.replan_io_wait_fraction, "expected a number in (0, 1)")
        if self.bandwidth_cap_gbps is not None and (isinstance(self.bandwidth_cap_gbps, bool) or not isinstance(
                self.bandwidth_cap_gbps, (int, float)) or not self.bandwidth_cap_gbps > 0):
            _fail("bandwidth_cap_gbps", self.bandwidth_cap_gbps, "expected GB/s > 0 or null")
        if self.job is not None and (not isinstance(self.job, str) or not self.job
                                     or "/" in self.job or self.job in (".", "..")):
            _fail("job", self.job, "expected a non-empty name without '/'")
        for name, minimum in (("host_memory_bytes", 0), ("aio_block_bytes", 4096),
                              ("aio_queue_depth", 1), ("aio_intra_op_parallelism", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                _fail(name, value, f"expected an integer >= {minimum}")
        if self.aio_block_bytes % 4096 or self.aio_block_bytes >= 1 << 31:
            _fail("aio_block_bytes", self.aio_block_bytes, "expected a multiple of 4096 below 2 GiB")
        if self.engine == "memory" and self.host_memory_bytes == 0:
            _fail("host_memory_bytes", self.host_memory_bytes,
                  "engine='memory' needs a pool; expected an integer > 0")
        if self.engine == "gds" and self.checksum:
            _fail("checksum", self.checksum, "engine='gds' moves bytes between the GPU and the file "
                  "without a host copy to check them on; use engine='posix' or 'aio' for checksums")
        if self.engine == "memory" and self.checksum:
            _fail("checksum", self.checksum, "engine='memory' keeps tensors in host RAM and writes "
                  "no file to check; drop checksum, or use engine='tiered' to check what spills to SSD")
        if self.engine == "gds":
            # Imported here, not at the top: the check needs torch, and kvikio is never imported.
            from .io.gds import gds_unavailable_reason

            why = gds_unavailable_reason()
            if why:
                _fail("engine", self.engine, why)

    def _check_activation_budget(self) -> None:
        b = self.activation_budget_bytes
        if b is None:
            return
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not b > 0 \
                or (isinstance(b, float) and b > 1 and not b.is_integer()):
            _fail("activation_budget_bytes", b, "expected a byte count >= 1 (e.g. 12GiB), a "
                  "fraction of device memory in (0, 1] (CUDA), or null")
        if isinstance(b, float) and b > 1:
            self.activation_budget_bytes = int(b)

    # -- derived values ---------------------------------------------------------------------

    def staging_bytes(self) -> int:
        """The pinned staging pool's size: ``pinned_staging_bytes``, or twice
        ``max_inflight_bytes`` (the writes in flight, and as much again for reads)."""
        if self.pinned_staging_bytes is not None:
            return self.pinned_staging_bytes
        return 2 * self.max_inflight_bytes

    def job_id(self) -> str:
        """The job id used in directory names and the {job} placeholder."""
        run_id = os.environ.get("TORCHELASTIC_RUN_ID")
        if run_id == "none":  # what torchrun sets without --rdzv-id
            run_id = None
        return self.job or os.environ.get("SLURM_JOB_ID") or run_id or "local"

    # -- YAML -------------------------------------------------------------------------------

    @classmethod
    def field_names(cls) -> tuple:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, data: dict, source: str = "config") -> "OffloadConfig":
        if not isinstance(data, dict):
            raise ConfigError(f"{source}: expected a mapping of OffloadConfig fields, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.field_names()))
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(map(str, unknown))}; allowed: "
                              + ", ".join(cls.field_names()))
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str) -> "OffloadConfig":
        """Load a config from YAML: either the fields at the top level, or under an
        ``offload:`` key (presets also describe the model and the parallel layout)."""
        import yaml

        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        if isinstance(data, dict) and "offload" in data:
            data = data["offload"] or {}
        return cls.from_dict(data, source=str(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes: Any) -> "OffloadConfig":
        return dataclasses.replace(self, **changes)
