"""OffloadConfig: the one object that flags, YAML presets and the Python API all produce.

Every field is typed, defaulted and documented right under it, and declared with ``knob()``
(config_checks.py), which carries its check, its command-line flag and the flag's help:
``megatron/args.py`` builds the "ssd offload" flags from these fields alone. ``__post_init__``
runs each field's check and the few cross-field rules, so a bad value fails before training
starts with a :class:`ConfigError` whose ``field``, ``value`` and ``allowed`` say what is wrong.
Nothing here probes the machine: an engine that cannot run here (gds without CUDA or kvikio,
aio without libaio) fails, with the reason, where it is built (io/__init__.py ``make_engine``),
so any preset loads on a login node.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, List, Optional

from .config_checks import (TEMPLATE_KEYS, ConfigError, activation_budget, boolean, choice_or_switch,
                            cpu_numbers, fail, field_checks, int_at_least, job_name, knob, layer_numbers, number_in,
                            one_of, optional_path_template, path_templates, warn_deprecated)

ENGINES = ("posix", "aio", "gds", "memory", "tiered")
MIN_TENSOR_BYTES = 256 * 1024  # min_tensor_bytes off CUDA (None: by device)
MIN_TENSOR_BYTES_CUDA = 1 << 20  # ... and on a CUDA device (the field's docstring says why)
VERIFY = ("off", "crc32c")
DEPRECATED_KEYS = ("checksum",)
POLICIES = ("offload", "adaptive", "keep")

__all__ = ["ConfigError", "ENGINES", "OffloadConfig", "POLICIES", "TEMPLATE_KEYS", "VERIFY"]


@dataclass
class OffloadConfig:
    """Settings of the SSD activation offloader.

    Example:
        >>> cfg = OffloadConfig(dirs=["/mnt/nvme0/ssdtrain/{job}", "/mnt/nvme1/ssdtrain/{job}"])
        >>> cfg.policy
        'offload'
    """

    dirs: List[str] = knob(
        default_factory=lambda: ["/tmp/ssdtrain"], check=path_templates, flag="--ssd-offload-dir",
        metavar="DIR[,DIR...]", help="Comma-separated offload roots, one per drive; path templates "
        "may use {rank}, {local_rank}, {hostname}, {job}, {user}")
    """Offload roots, one per drive; tensors are striped across them. Path templates may use
    {rank}, {local_rank}, {hostname}, {job} and {user} (the login name the job runs as: a folder
    per user on a shared drive, docs/cluster.md). Each rank creates its own 0700 directory under
    every root and removes it when it closes, with the job folders (from the first component
    holding {job} on) that this leaves empty. A root (the part above the first {job}
    component) must exist: see ``create_dirs``."""

    create_dirs: bool = knob(False, check=boolean, help=(
        "Create an offload root that does not exist (the part of a dirs template above its first "
        "{job} component). Off: a missing root is refused, since it usually means a drive that is "
        "not mounted, and creating it would write onto the system disk"))
    """Create an offload root that does not exist (the part of a ``dirs`` template above its
    first {job} component; io/roots.py). Off: a missing root is refused, since it usually means
    a drive that is not mounted, and creating the path would write onto the system disk."""

    allow_system_disk: bool = knob(False, check=boolean, help=(
        "Let an offload root lie on the filesystem of / (the system disk). Off: the launcher's "
        "pre-flight and `ssdtrain doctor --preflight` refuse such a root before Megatron starts, "
        "since filling it can stop the node; the offloader itself only warns"))
    """Let an offload root lie on the filesystem of ``/`` (the system disk). Off: the launcher's
    pre-flight (megatron/preflight.py) and ``ssdtrain doctor --preflight`` refuse such a root
    before Megatron starts, since filling it can stop the node. The offloader itself, built
    without the launcher (the Python API, the demo), only warns."""

    allow_untested_megatron: bool = knob(False, check=boolean, help=(
        "Let a megatron-core minor release newer than any tested run with the newest tested "
        "release's patch points, once each is found with its expected parameters; one warning "
        "at start names the version and what was assumed. Off: such a release is refused"))
    """Let a megatron-core minor release newer than any this version of ssdtrain was tested
    against (megatron/compat.py ``RELEASES``) run, with the patch points of the newest tested
    one, once ``patch_points.verify`` has found each of them with the parameters the hooks rely on
    (a missing or changed one is refused all the same). ``install()`` then logs one warning
    naming the version and what it assumed. Off: such a release is refused, in one line that
    names this setting's flag. An older release is refused either way."""

    engine: str = knob("posix", check=one_of(ENGINES), choices=ENGINES, help=(
        "IO engine: 'posix' (thread pool, O_DIRECT; no build step), 'aio' (DeepSpeed DeepNVMe "
        "aio_handle; needs libaio-dev and a one-time JIT build), 'gds' (kvikio/cuFile; CUDA "
        "only), 'memory' (host RAM pool of host_memory_bytes) or 'tiered' (host RAM of "
        "host_memory_bytes and SSD, each layer where the plan places it). Default: where neither "
        "this flag nor the preset names one, it follows the node: 'tiered' where host memory is "
        "to spare, else 'posix', logged at start (INFO; docs/flags.md)"))
    """IO engine: 'posix' (thread pool, O_DIRECT; the default, no build step), 'aio' (DeepSpeed
    DeepNVMe aio_handle; needs libaio-dev and a one-time JIT build), 'gds' (kvikio/cuFile; CUDA
    only), 'memory' (host RAM pool of host_memory_bytes) or 'tiered' (host RAM of
    host_memory_bytes and SSD: each layer where the plan places it, 'host' or 'ssd'; a layer
    whose decision is 'offload' to host RAM while it has room, SSD beneath; io/tiered.py).
    Where a job's flags and preset name none, the launcher and ``ssdtrain plan`` choose it for
    the node, tiered where host memory is to spare, else posix (megatron/follow_node.py,
    plan/engine_choice.py); this object, built in Python, runs what it says."""

    policy: str = knob("offload", check=one_of(POLICIES), choices=POLICIES, help=(
        "'offload' writes every eligible activation to the engine; 'adaptive' lets the planner "
        "decide per layer; 'keep' installs the offloader but keeps everything in memory (the "
        "baseline). Default: 'offload'; where neither this flag nor the preset sets it and the "
        "node chooses 'tiered', 'adaptive' if an activation or memory budget is set"))
    """'offload' writes every eligible activation to the engine; 'adaptive' lets the planner
    decide per layer; 'keep' installs the offloader but keeps everything in memory (the
    baseline). Where neither a flag nor the preset sets it and the launcher (or ``ssdtrain
    plan``) chooses 'tiered' for the node, it is 'adaptive' if ``activation_budget_bytes`` or
    ``memory_budget_bytes`` is set, else 'offload' (plan/engine_choice.py ``tiered_settings``)."""

    min_tensor_bytes: Optional[int] = knob(None, check=int_at_least(0, optional=True), unit="bytes", help=(
        "Saved tensors smaller than this stay in memory (IO per byte is too costly for them); "
        "default: 1 MiB on a CUDA device, 256 KiB elsewhere"))
    """Saved tensors smaller than this stay in memory (IO per byte is too costly for them).
    None (the default): 1 MiB on a CUDA device, 256 KiB elsewhere (``min_bytes_for``). On a GPU
    each offloaded record costs the training thread a few microseconds and the offload and
    reload streams a copy launch each way, whatever its size; below about 1 MiB that costs
    more than moving the bytes saves (a 256 KiB copy takes about 5 us over a 50 GB/s link, its
    launch and bookkeeping about as much), and what is that small is rarely what fills the
    device: RoPE's cos/sin tables (256 KiB each at sequence 1024, saved in every layer),
    masks, per-token statistics."""

    keep_last_layers: int = knob(1, check=int_at_least(0), help=(
        "Per micro-batch, the last N annotated layers stay in memory when that micro-batch's "
        "backward follows its forward immediately (their backward starts right away)"))
    """Per micro-batch, the last N annotated layers stay in memory when that micro-batch's
    backward follows its forward immediately (their backward starts right away). What is saved
    after the last layer (a model's head, the loss) stays then too, even with 0. With 0 on a
    stage whose backward follows its forward (a pipeline's last stage), the last layer is
    written while backward is about to need it: writes still under way are forwarded from
    memory, written for nothing (StepStats.bytes_wasted_by_origin)."""

    prefetch_layers: int = knob(2, check=int_at_least(1), help=(
        "During backward, how many layers ahead of the one being differentiated are read back "
        "at first, and at least; after a step the window follows the measured read bandwidth and "
        "compute (enough that reads arrive before backward needs them), within max_inflight_bytes "
        "and the budget"))
    """During backward, how many layers ahead of the one being differentiated are read back at
    first, and at least: once a step has measured its reads, the window is as wide as the reads
    need to arrive before backward reaches them (the link's time for a layer's bytes over a
    layer's backward compute, plus one; plan/readahead.py), within the read-ahead byte cap
    (``max_inflight_bytes``) and the activation budget."""

    max_inflight_bytes: int = knob(1 << 30, check=int_at_least(1), unit="bytes", help=(
        "Cap on bytes being written at once; pack waits (and counts the wait) beyond it, so "
        "pending writes cannot pin unbounded memory"))
    """Cap on bytes being written at once; pack waits (and counts the wait) beyond it, so
    pending writes cannot pin unbounded memory."""

    pinned_staging_bytes: Optional[int] = knob(None, check=int_at_least(1, optional=True), unit="bytes",
                                               help=(
        "GPU only: page-locked host memory allocated once, through which activations are copied "
        "between the GPU and the engine (writes and reads in flight share it)"))
    """GPU only: page-locked host memory allocated once, through which activations are copied
    between the GPU and the engine (writes and reads in flight share it). None: twice
    max_inflight_bytes. A copy that does not fit uses torch's pinned allocator (warned)."""

    verify: str = knob("off", check=choice_or_switch(VERIFY, "off", "crc32c"), choices=VERIFY,
                       deprecated_switch=("--ssd-offload-checksum", "crc32c", "off"), help=(
        "'crc32c': store a CRC32C (io/checksum.py) of every written chunk and verify it on read; "
        "a mismatch stops the step with an error naming the layer and the file (posix, aio and "
        "the SSD tier of tiered; refused with gds and memory). 'off': a byte changed on the drive "
        "reaches backward unnoticed. Cost: two CRC32C passes per offloaded byte on the IO threads "
        "(about 16 GB per CPU-second per core in hardware); measured on a quiet 2-core CPU "
        "machine at the bench's default shape: step time and process CPU x1.03, over the "
        "x1.02 rule for turning it on by default (docs/benchmarks.md, \"Checksum cost\")"))
    """'crc32c': store a CRC32C (io/checksum.py) of every written chunk and verify it on read;
    a mismatch is retried, then stops the step with an error naming the tensor's layer and the
    file. Works with posix, aio and the SSD tier of tiered; refused with gds, which keeps no
    host copy to check, and with memory, which writes no file. 'off': a byte changed on the
    drive between write and read reaches backward as a wrong activation, unreported.
    Off by default: its measured cost (docs/benchmarks.md, "Checksum cost": +3% step time on a
    quiet CPU machine) is over 2% of step time, the rule for turning it on by default.
    In YAML an unquoted ``off`` reads as false, which means 'off' here (true means 'crc32c').
    Replaces the boolean ``checksum`` (still accepted, deprecated: true is 'crc32c')."""

    stats_path: Optional[str] = knob(None, check=optional_path_template("expected a file path or null"),
                                     metavar="PATH", help=(
        "When set, each step's StepStats is appended to this file as one JSON line"))
    """When set, each step's StepStats is appended to this file as one JSON line. A path
    template like ``dirs`` ({rank}, ...): give each rank its own file. A restarted job (the
    same command line) appends to the same file; a directory there is refused at start, and so
    is anything but a plain file of ours that nobody else may write (a symlink, even at a fixed
    path; a FIFO; another user's file): docs/cluster.md, "Shared roots"."""

    io_threads: int = knob(4, check=int_at_least(1), help=(
        "Worker threads of the IO engine (each keeps one request in flight); gds: also the "
        "size of kvikio's thread pool"))
    """Worker threads of the IO engine (each keeps one request in flight); for 'gds' also the
    size of kvikio's thread pool (unless KVIKIO_NTHREADS is set)."""

    io_cpus: List[int] = knob(default_factory=list, check=cpu_numbers, metavar="CPU[,CPU...]", help=(
        "CPUs the IO engine's threads run on (each confines itself when it starts); empty: "
        "wherever the process runs. On a GPU node: cores near the drives that the training "
        "process is not bound to"))
    """CPUs the IO engine's threads run on (each thread confines itself with
    ``sched_setaffinity`` when it starts; io/affinity.py); empty: wherever the process runs.
    On a GPU node: cores near the drives (their NUMA node) that the training process is not
    bound to, so that copies and checksums never take the core that launches the kernels.
    Building an engine refuses CPUs this process may not use."""

    chunk_bytes: int = knob(8 << 20, check=int_at_least(4096, multiple_of=4096), unit="bytes", help=(
        "Tensors are written in chunks of at most this many bytes, striped over the roots; a "
        "multiple of 4096"))
    """Tensors are written in chunks of at most this many bytes, striped over the roots;
    a multiple of 4096."""

    io_timeout_s: float = knob(300.0, check=number_in(0, allowed="expected a number of seconds > 0",
                                                      as_float=True),
                               metavar="SECONDS", help=(
        "Every wait on IO raises after this many seconds, naming what was pending"))
    """Every wait on IO raises after this many seconds, naming what was pending."""

    trace_path: Optional[str] = knob(None, check=optional_path_template(
        "expected a file path template or null"), metavar="PATH", help=(
        "Opt-in IO trace: one JSON line per IO request (time, rank, micro-batch, layer, phase, op, "
        "bytes, file offset, latency, queue depth), for `ssdtrain report`. A path template like "
        "``dirs`` ({rank}, ...); give each rank its own file"))
    """Opt-in IO trace: one JSON line per IO request (time, rank, micro-batch, layer, phase, op,
    bytes, file offset, latency, queue depth), for `ssdtrain report`. A path template like
    ``dirs`` ({rank}, ...); give each rank its own file. Appended to, like ``stats_path``."""

    debug_save_sites: bool = knob(False, check=boolean, help=(
        "Debugging: note the Python call site that saved each offloaded tensor (a stack walk per "
        "tensor, so never in a run that is timed), and name it in StepStats.bytes_wasted_by_origin"))
    """Debugging: note the Python call site that saved each offloaded tensor, so that
    ``StepStats.bytes_wasted_by_origin`` names the code behind every wasted byte, not only its
    layer, dtype and shape. A stack walk per offloaded tensor (tens of µs): for finding where
    waste comes from, never in a run that is timed. Off: the pack hook does no extra work."""

    memory_budget_bytes: Optional[int] = knob(None, check=int_at_least(0, optional=True), unit="bytes",
                                              help=(
        "Adaptive policy: activation bytes of one micro-batch allowed to stay in memory"))
    """Adaptive policy: activation bytes of one micro-batch allowed to stay in memory. None:
    as little as possible without stalling on IO."""

    activation_budget_bytes: Optional[float] = knob(
        None, check=activation_budget, flag="--ssd-offload-activation-budget", unit="bytes|fraction",
        metavar="SIZE|FRACTION", help=(
            "A hard cap on resident activation bytes (kept, being written, read back or read "
            "ahead): pack waits for writes, prefetch reads less, adaptive plans within it. A size "
            "like 12GiB, or on CUDA a fraction of device memory like 0.6"))
    """A hard cap on resident activation bytes (kept, being written, read back or read ahead):
    pack waits for writes, prefetch reads less, and adaptive plans within it. Bytes (flag: sizes
    like 12GiB), or on CUDA a fraction of the device's memory in (0, 1], e.g. 0.6. None: no cap.
    Not applied with policy 'keep' (the baseline writes nothing to make room with)."""

    recompute_fallback: bool = knob(False, check=boolean, help=(
        "Layers that cannot be offloaded without stalling are recomputed instead (Megatron "
        "integration: they run under megatron's own tensor_parallel.checkpoint). Default: off; "
        "where neither this flag nor the preset sets it and the node chooses 'tiered', on when "
        "the policy is 'adaptive' (not with Megatron-DeepSpeed)"))
    """Layers that cannot be offloaded without stalling are recomputed instead (Megatron
    integration: they run under megatron's own tensor_parallel.checkpoint). Where neither a flag
    nor the preset sets it and the launcher (or ``ssdtrain plan``) chooses 'tiered' for the
    node, it is on when the policy that runs is 'adaptive', except with Megatron-DeepSpeed,
    which cannot recompute a layer (plan/engine_choice.py ``tiered_settings``)."""

    recompute_layers: List[int] = knob(default_factory=list, check=layer_numbers, help=(
        "Static recompute plan: layer numbers (1-based, as Megatron numbers them) run under "
        "checkpointing instead of being offloaded, when recompute_fallback is on"))
    """Static recompute plan: layer numbers (1-based, as Megatron numbers them) run under
    checkpointing instead of being offloaded, when recompute_fallback is on."""

    replan_io_wait_fraction: float = knob(0.05, check=number_in(0, 1, "expected a number in (0, 1)"),
                                          metavar="F", help=(
        "Adaptive policy: re-plan when a step waits on IO for more than this fraction of it"))
    """Adaptive policy: re-plan when a step waits on IO for more than this fraction of it."""

    adaptive_explore_steps: int = knob(21, check=int_at_least(0), metavar="N", help=(
        "Adaptive policy: steps per exploration round that may run plans other than the best "
        "measured so far (each tried for adaptive_trial_steps steps, each step followed by one of "
        "the best plan, so a round lasts up to twice as many); 0: run the model's plan"))
    """Adaptive policy: steps per exploration round that may run plans other than the best
    measured so far, each tried for ``adaptive_trial_steps`` steps, each step followed by one of
    the best plan so far to compare with (plan/explore.py): a round lasts up to twice this many
    steps. 0: no measuring, the model's plan runs as it did before measured selection."""

    adaptive_trial_steps: int = knob(3, check=int_at_least(1), metavar="N", help=(
        "Adaptive policy: steps each plan runs before its median step time is compared"))
    """Adaptive policy: steps each plan runs before its median step time is compared."""

    adaptive_min_gain: float = knob(0.02, check=number_in(0, 1, "expected a number in (0, 1)"),
                                    metavar="F", help=(
        "Adaptive policy: a plan replaces the best measured one only when its steps are faster than "
        "the best one's steps beside them by more than this fraction (the median of the paired "
        "ratios; or by more than their spread, if larger) and every paired step was faster"))
    """Adaptive policy: a plan replaces the best measured one only when its steps are faster than
    the best one's steps beside them (the median of the paired ratios) by more than this
    fraction, or by more than the ratios' spread if that is larger, and every paired step was
    faster."""

    adaptive_drift: float = knob(0.15, check=number_in(0, 1, "expected a number in (0, 1)"),
                                 metavar="F", help=(
        "Adaptive policy: once settled, re-explore (bounded) when the median step time moves by "
        "more than this fraction"))
    """Adaptive policy: once settled, re-explore (bounded by ``adaptive_explore_steps``) when the
    median of the last ``adaptive_trial_steps`` step times moves by more than this fraction."""

    bandwidth_cap_gbps: Optional[float] = knob(None, check=number_in(0, None, "expected GB/s > 0 or null",
                                                                     optional=True),
                                               metavar="GB/S", help=(
        "Cap on the engine's bandwidth in GB/s (reads and writes share it), emulating a slower "
        "drive: for tests and what-if runs; with 'tiered', its SSD tier's"))
    """Cap on the engine's bandwidth in GB/s (reads and writes share it), emulating a slower
    drive: for tests and what-if runs. With 'tiered' it caps the SSD tier only (host memory is
    not a drive). None: no cap."""

    job: Optional[str] = knob(None, check=job_name, help=(
        "Job id for the {job} placeholder and directory names; default: SLURM_JOB_ID, "
        "TORCHELASTIC_RUN_ID, or 'local'"))
    """Job id for the {job} placeholder and directory names; default: SLURM_JOB_ID,
    TORCHELASTIC_RUN_ID, or 'local'."""

    host_memory_bytes: int = knob(4 << 30, check=int_at_least(0), unit="bytes", help=(
        "Size of the host-memory pool of the 'memory' engine and of the memory tier of 'tiered' "
        "(pinned when CUDA exists, plain host memory otherwise). Default: 4 GiB; where the node "
        "chose 'tiered' for a model it planned, what the plan puts in host memory and one layer "
        "more, within what is free"))
    """Size of the host-memory pool of the 'memory' engine and of the memory tier of 'tiered'
    (pinned when CUDA exists, plain host memory otherwise). 'memory' fails a write that does
    not fit; 'tiered' sends it to SSD instead. Unset where the node chose 'tiered' for a model
    it planned (the launcher), what the plan puts in host memory per rank and one layer more,
    within what is free (plan/engine_choice.py)."""

    aio_block_bytes: int = knob(1 << 20, check=int_at_least(4096, multiple_of=4096, below=1 << 31),
                                unit="bytes", help=(
        "'aio' engine: bytes per libaio request; a multiple of 4096"))
    """'aio' engine: bytes per libaio request; a multiple of 4096."""

    aio_queue_depth: int = knob(8, check=int_at_least(1), help=(
        "'aio' engine: libaio requests each aio thread keeps in flight"))
    """'aio' engine: libaio requests each aio thread keeps in flight."""

    aio_intra_op_parallelism: int = knob(1, check=int_at_least(1), help=(
        "'aio' engine: threads DeepNVMe splits each chunk across (every request is padded to a "
        "multiple of 4096 times this)"))
    """'aio' engine: threads DeepNVMe splits each chunk across (every request is padded to a
    multiple of 4096 times this)."""

    checksum: dataclasses.InitVar[Optional[bool]] = None
    """Deprecated spelling of ``verify`` (true: 'crc32c', false: 'off'), accepted when a config
    is built (Python, YAML) and logged once as deprecated; not stored: read ``verify``."""

    def __post_init__(self, checksum: Optional[bool]) -> None:
        # Each field's own check (declared with it), in field order; then the rules that tie
        # two fields together. Nothing here probes the machine (see the module docstring).
        for name, check in field_checks(type(self)):
            setattr(self, name, check(name, getattr(self, name)))
        if checksum is not None:
            self._take_deprecated_checksum(boolean("checksum", checksum))
        self._check_engine_settings()

    def _take_deprecated_checksum(self, checksum: bool) -> None:
        warn_deprecated("OffloadConfig key 'checksum'", "verify: crc32c (or off; flag "
                        "--ssd-offload-verify)")
        wanted = "crc32c" if checksum else "off"
        if self.verify not in ("off", wanted):
            fail("checksum", checksum, f"contradicts verify={self.verify!r}; drop the deprecated "
                 "checksum key and keep verify")
        self.verify = wanted

    def _check_engine_settings(self) -> None:
        if self.engine == "memory" and self.host_memory_bytes == 0:
            fail("host_memory_bytes", self.host_memory_bytes,
                 "engine='memory' needs a pool; expected an integer > 0")
        if self.engine == "gds" and self.verify != "off":
            fail("verify", self.verify, "engine='gds' moves bytes between the GPU and the file "
                 "without a host copy to check them on; use engine='posix' or 'aio' to verify")
        if self.engine == "memory" and self.verify != "off":
            fail("verify", self.verify, "engine='memory' keeps tensors in host RAM and writes "
                 "no file to check; use verify='off', or engine='tiered' to verify what spills to SSD")

    # -- derived values ---------------------------------------------------------------------

    def min_bytes_for(self, device) -> int:
        """``min_tensor_bytes`` on ``device`` (a torch.device or its type): the value set, else
        MIN_TENSOR_BYTES_CUDA on a CUDA device and MIN_TENSOR_BYTES elsewhere."""
        if self.min_tensor_bytes is not None:
            return self.min_tensor_bytes
        kind = getattr(device, "type", device)
        return MIN_TENSOR_BYTES_CUDA if kind == "cuda" else MIN_TENSOR_BYTES

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
            raise ConfigError(f"{source}: expected a mapping of OffloadConfig fields, got {type(data).__name__}",
                              allowed="a mapping of OffloadConfig fields")
        unknown = sorted(set(data) - set(cls.field_names()) - set(DEPRECATED_KEYS))
        if unknown:
            raise ConfigError(f"{source}: unknown key(s) {', '.join(map(str, unknown))}; allowed: "
                              + ", ".join(cls.field_names()), allowed=", ".join(cls.field_names()))
        return cls(**data)

    @classmethod
    def from_yaml(cls, path: str) -> "OffloadConfig":
        """Load a config from YAML: either the fields at the top level, or under an
        ``offload:`` key (presets also describe the model and the parallel layout)."""
        return cls.from_dict(cls.yaml_section(path), source=str(path))

    @staticmethod
    def yaml_section(path: str) -> Any:
        """What :meth:`from_yaml` reads from the file: its ``offload:`` section, or the whole
        document without one (an empty file: {}; not checked to be a mapping)."""
        import yaml

        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
        if isinstance(data, dict) and "offload" in data:
            data = data["offload"] or {}
        return data

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes: Any) -> "OffloadConfig":
        return dataclasses.replace(self, **changes)

