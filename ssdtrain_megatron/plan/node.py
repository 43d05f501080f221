"""The node a job runs on, as the planner sees it: :class:`NodeProfile`.

A profile says what each GPU of a node has around it for activations: its own memory and
achieved compute, the host memory it may use and the link to it, the node's drives and their
rated endurance, and NVLink for tensor-parallel traffic. The planner (plan/tiers.py) places each
layer's activations in one of four places from these figures; ``ssdtrain doctor --node-profile
OUT.yaml`` writes the profile of the machine it runs on, in this schema.

Built-in profiles (:data:`BUILTIN`) describe common nodes from public datasheets and published
Megatron throughput; docs/models.md cites the source of each figure. They are planning figures,
not measurements of your node: measure yours (``doctor --node-profile``) and plan with that.

Units: bytes are exact integers; bandwidths are decimal GB/s (1e9 bytes/s), per direction;
TBW is decimal TB (1e12 bytes) written per drive; TFLOP/s is 1e12 FLOP/s.

Pure: imports no torch; PyYAML only when a file is read or written.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from ..sizes import parse_size_with_unit
from .profile_checks import ProfileError, _fail, _is_int, _is_number

GB = 10 ** 9


@dataclass(frozen=True)
class NodeProfile:
    """One kind of node: per GPU what it has for activations, per node its drives.

    Example:
        >>> node = load_profile("dgx-h100")
        >>> node.gpus_per_node, round(node.ssd_write_gbps, 2)
        (8, 3.8)
    """

    name: str
    """A short name (``dgx-h100``); the built-ins are :data:`BUILTIN`."""

    gpus_per_node: int
    """GPUs in one node (they share its drives)."""

    gpu_memory_bytes: int
    """Memory of one GPU, bytes (80 GB: 80_000_000_000)."""

    gpu_tflops: float
    """Achieved bf16 TFLOP/s per GPU in Megatron training (model FLOPs over step time), not
    the datasheet's peak: the planner's compute time is FLOPs / this."""

    host_memory_bytes: int
    """Host memory one GPU may fill with activations, bytes: its share of the node's memory
    less what the data loader, pinned buffers, checkpoint staging and the OS need. 0: no host
    tier."""

    host_link_gbps: float
    """GB/s between one GPU and host memory in each direction (pinned copies; PCIe or
    NVLink-C2C), with every GPU of the node copying at once. SSD traffic crosses it too: the
    offloader bounces drive IO through pinned host memory."""

    drives: int
    """Drives per node that take activations (0: no SSD tier)."""

    drive_write_gbps: float
    """Sustained sequential write GB/s of one drive."""

    drive_read_gbps: float
    """Sustained sequential read GB/s of one drive."""

    drive_tbw_tb: float
    """Rated endurance of one drive, TB written (the vendor's TBW, or DWPD x capacity x
    warranty days)."""

    nvlink_gbps: float
    """GB/s of one GPU's NVLink in each direction, for tensor-parallel communication."""

    source: str = ""
    """Where the figures come from (a datasheet, a measurement and its date)."""

    host_memory_gbps: Optional[float] = None
    """GB/s of the node's host memory, reads and writes together (DDR channels x their rate;
    a DGX H100's two Xeons: 16 DDR5-4800 channels, 614 GB/s), shared by every GPU of the node.
    Each GPU copies both ways at once (one micro-batch's forward writes while another's backward
    reads), so its host tier runs at min(host_link_gbps, host_memory_gbps / gpus_per_node / 2)
    each way (:attr:`host_copy_gbps`). None: not known, the host link alone (said so)."""

    gpu_tflops_by_tokens: Optional[Tuple[Tuple[int, float], ...]] = None
    """Achieved TFLOP/s measured at given tokens per micro-batch on one GPU (b x s / cp: the rows
    of its GEMMs), replacing ``gpu_tflops`` where given: small micro-batches run GEMMs below
    the GPU's efficiency. A mapping in YAML (``{2048: 310, 8192: 400}``); a micro-batch gets the
    figure measured at the most tokens not above its own (below the least, the least's): the
    measurements as they are, no curve fitted between them. None: ``gpu_tflops`` at every
    micro-batch (said so in the plan's assumptions)."""

    cpu_adam_params_per_s: Optional[float] = None
    """Parameters per second one GPU's rank steps with torch's fused AdamW on the CPU (the
    class megatron-core's optimizer CPU offload uses), every local rank stepping at once on its
    share of the cores and of the memory bus. ``ssdtrain doctor --node-profile`` measures it;
    the built-in profiles carry an estimate (:data:`CPU_ADAM_ESTIMATES`). None: not known (a
    plan with optimizer offload then says it cannot price the CPU step)."""

    gpu_kind: Optional[str] = None
    """The GPU's kind (plan/gpu_kind.py: ``h100-sxm``, ``h200``, ``gh200``, ``a100-sxm``,
    ``b200``): GEMMs by shape and precision, attention and memory-bound passes at its rates
    (plan/step_time.py). None: every FLOP at ``gpu_tflops``, the one achieved rate."""

    nics: int = 0
    """Network adapters per node for traffic between nodes (DGX H100: 8). 0: not known
    (traffic between nodes priced as NVLink's, said so)."""

    nic_gbps: float = 0.0
    """Gb/s of one NIC (bits: InfiniBand NDR is 400)."""

    gemm_efficiency: Optional[float] = None
    """Measured fraction of the kind's peak its large GEMMs reach (replaces the kind's)."""

    gemm_tflops_by_shape: Optional[Tuple[Tuple[int, int, int, str, float], ...]] = None
    """Measured TFLOP/s of torch matmuls at given GEMM shapes (``ssdtrain doctor --node-profile``
    on a GPU: tools/gemm_sweep.py): in YAML a list of ``{m, n, k, dtype, tflops}`` (dtype
    ``bf16`` or ``fp8``), held as (m, n, k, dtype, tflops) tuples. With ``gpu_kind`` set, each
    of the job's GEMMs runs at the rate of the nearest measured shape of its dtype
    (plan/gpu_kind.py ``nearest_measured``) instead of the kind's efficiency and waves. None:
    the kind's (said so in the plan's assumptions)."""

    FIELDS = ("name", "gpus_per_node", "gpu_memory_bytes", "gpu_tflops", "host_memory_bytes",
              "host_link_gbps", "drives", "drive_write_gbps", "drive_read_gbps", "drive_tbw_tb",
              "nvlink_gbps", "source", "host_memory_gbps", "gpu_tflops_by_tokens", "gpu_kind",
              "nics", "nic_gbps", "gemm_efficiency")
    OPTIONAL = ("source", "host_memory_gbps", "gpu_tflops_by_tokens", "gpu_kind", "nics",
                "nic_gbps", "gemm_efficiency")
    FIELDS += ("cpu_adam_params_per_s",)
    OPTIONAL += ("cpu_adam_params_per_s",)
    FIELDS += ("gemm_tflops_by_shape",)
    OPTIONAL += ("gemm_tflops_by_shape",)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            _fail("name", self.name, "expected a non-empty string")
        if not isinstance(self.source, str):
            _fail("source", self.source, "expected a string")
        if not _is_int(self.gpus_per_node) or self.gpus_per_node < 1:
            _fail("gpus_per_node", self.gpus_per_node, "expected an integer >= 1")
        if not _is_int(self.drives) or self.drives < 0:
            _fail("drives", self.drives, "expected an integer >= 0 (0: no SSD tier)")
        if not _is_int(self.gpu_memory_bytes) or self.gpu_memory_bytes < 1 << 20:
            _fail("gpu_memory_bytes", self.gpu_memory_bytes,
                  "expected bytes >= 1MiB (a size with a unit, e.g. 80GB)")
        if not _is_int(self.host_memory_bytes) or self.host_memory_bytes < 0:
            _fail("host_memory_bytes", self.host_memory_bytes,
                  "expected bytes >= 0 (a size with a unit, e.g. 150GB; 0: no host tier)")
        for name in ("gpu_tflops", "host_link_gbps", "nvlink_gbps"):
            value = getattr(self, name)
            if not _is_number(value) or not 0 < value < float("inf"):
                _fail(name, value, "expected a number > 0")
        if self.gpu_tflops_by_tokens is not None:
            object.__setattr__(self, "gpu_tflops_by_tokens",
                               _tflops_table(self.gpu_tflops_by_tokens))
        if self.gemm_tflops_by_shape is not None:
            from .gemm_table import gemm_table

            object.__setattr__(self, "gemm_tflops_by_shape", gemm_table(self.gemm_tflops_by_shape))
        if self.gpu_kind is not None:
            from .gpu_kind import KINDS

            if self.gpu_kind not in KINDS:
                _fail("gpu_kind", self.gpu_kind, "allowed: " + ", ".join(KINDS) + ", or null")
        if not _is_int(self.nics) or self.nics < 0:
            _fail("nics", self.nics, "expected an integer >= 0 (0: not known)")
        if not _is_number(self.nic_gbps) or self.nic_gbps < 0 or (self.nics and not self.nic_gbps):
            _fail("nic_gbps", self.nic_gbps, "expected Gb/s > 0 where nics is given")
        if self.gemm_efficiency is not None and (
                not _is_number(self.gemm_efficiency) or not 0 < self.gemm_efficiency <= 1):
            _fail("gemm_efficiency", self.gemm_efficiency, "expected a number in (0, 1], or null")
        if self.host_memory_gbps is not None and (
                not _is_number(self.host_memory_gbps)
                or not 0 < self.host_memory_gbps < float("inf")):
            _fail("host_memory_gbps", self.host_memory_gbps,
                  "expected a number > 0, or null (not known)")
        if isinstance(self.cpu_adam_params_per_s, str):  # YAML reads 2.5e9 (no dot) as text
            try:
                object.__setattr__(self, "cpu_adam_params_per_s", float(self.cpu_adam_params_per_s))
            except ValueError:
                pass
        if self.cpu_adam_params_per_s is not None and (
                not _is_number(self.cpu_adam_params_per_s)
                or not 0 < self.cpu_adam_params_per_s < float("inf")):
            _fail("cpu_adam_params_per_s", self.cpu_adam_params_per_s,
                  "expected a number > 0 (parameters per second), or null (not known)")
        for name in ("drive_write_gbps", "drive_read_gbps", "drive_tbw_tb"):
            value = getattr(self, name)
            low_ok = value >= 0 if self.drives == 0 else value > 0
            if not _is_number(value) or not low_ok or value == float("inf"):
                _fail(name, value, "expected a number > 0" if self.drives else
                      "expected a number >= 0 (drives is 0)")

    # -- per GPU ---------------------------------------------------------------------------

    @property
    def ssd_write_gbps(self) -> float:
        """GB/s of drive writes one GPU gets when every GPU of the node writes at once."""
        return self.drives * self.drive_write_gbps / self.gpus_per_node

    @property
    def ssd_read_gbps(self) -> float:
        """GB/s of drive reads one GPU gets when every GPU of the node reads at once."""
        return self.drives * self.drive_read_gbps / self.gpus_per_node

    @property
    def host_copy_gbps(self) -> float:
        """GB/s each way between one GPU and host memory when every GPU of the node copies
        both ways at once: the link, or its share of the memory bus where that is less."""
        if self.host_memory_gbps is None:
            return self.host_link_gbps
        return min(self.host_link_gbps, self.host_memory_gbps / self.gpus_per_node / 2)

    @property
    def gpu_flops(self) -> float:
        """Achieved FLOP/s of one GPU."""
        return self.gpu_tflops * 1e12

    def flops_at(self, tokens: int) -> float:
        """Achieved FLOP/s of one GPU at ``tokens`` per micro-batch (b x s / cp): the measured
        figure at the most tokens not above it (:attr:`gpu_tflops_by_tokens`), else
        :attr:`gpu_flops`."""
        table = self.gpu_tflops_by_tokens
        if not table:
            return self.gpu_flops
        below = [tflops for at, tflops in table if at <= tokens]
        return (below[-1] if below else table[0][1]) * 1e12

    def describe(self) -> str:
        """One line: the figures the planner reads."""
        drives = (f"{self.drives} drives of {self.drive_write_gbps:g} / {self.drive_read_gbps:g} "
                  f"GB/s write / read, {self.drive_tbw_tb:,g} TBW each (per GPU "
                  f"{self.ssd_write_gbps:.2f} / {self.ssd_read_gbps:.2f} GB/s)"
                  if self.drives else "no drives")
        measured = (f", its GEMMs by {len(self.gemm_tflops_by_shape)} measured shapes"
                    if self.gemm_tflops_by_shape else "")
        rate = (f"{self.gpu_kind} (its GEMM, attention and memory rates{measured})"
                if self.gpu_kind and not self.gpu_tflops_by_tokens else f"{self.gpu_tflops:g} TFLOP/s")
        return (f"{self.name}: {self.gpus_per_node} GPUs of {self.gpu_memory_bytes / GB:g} GB at "
                f"{rate}; host memory {self.host_memory_bytes / GB:g} GB per "
                f"GPU over {self.host_link_gbps:g} GB/s each way{self._bus()}; {drives}; NVLink "
                f"{self.nvlink_gbps:g} GB/s")

    def _bus(self) -> str:
        if self.host_memory_gbps is None:
            return " (the host memory bus they share: not known, not checked)"
        return (f" (the {self.host_memory_gbps:g} GB/s host memory bus shared by "
                f"{self.gpus_per_node} GPU(s) both ways: {self.host_copy_gbps:.1f} GB/s each)")

    def replace(self, **changes: Any) -> "NodeProfile":
        return dataclasses.replace(self, **changes)

    # -- dict and YAML ---------------------------------------------------------------------

    def to_dict(self) -> Dict[str, Any]:
        """The fields, in schema order (what :meth:`from_dict` and the YAML file hold)."""
        out = {name: getattr(self, name) for name in self.FIELDS}
        if self.gpu_tflops_by_tokens is not None:
            out["gpu_tflops_by_tokens"] = dict(self.gpu_tflops_by_tokens)
        if self.gemm_tflops_by_shape is not None:
            from .gemm_table import table_rows

            out["gemm_tflops_by_shape"] = table_rows(self.gemm_tflops_by_shape)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "node") -> "NodeProfile":
        """A profile from a mapping of its fields. ``base: NAME`` (a built-in or a YAML path)
        starts from that profile and the other keys override it. Byte fields take an integer
        or a size with a unit ('80GB'); a plain number as text is refused.

        Raises:
            ProfileError: one line naming ``source``, the field, the value and what is allowed.
        """
        if not isinstance(data, Mapping):
            raise ProfileError(f"{source}: expected a node profile's name or a mapping of its "
                               f"fields, got {type(data).__name__}")
        allowed = cls.FIELDS + ("base",)
        unknown = sorted(str(k) for k in data if k not in allowed)
        if unknown:
            raise ProfileError(f"{source}: unknown key(s) {', '.join(unknown)}; allowed: "
                               + ", ".join(allowed))
        fields: Dict[str, Any] = {}
        if "base" in data:
            fields.update(load_profile(str(data["base"])).to_dict())
        for key, value in data.items():
            if key == "base":
                continue
            if key.endswith("_bytes") and isinstance(value, str):
                try:
                    value = parse_size_with_unit(value)
                except ValueError as exc:
                    raise ProfileError(f"{source}.{key}: {exc}") from None
            fields[key] = value
        missing = [k for k in cls.FIELDS if k not in fields and k not in cls.OPTIONAL]
        if missing:
            raise ProfileError(f"{source}: missing key(s) {', '.join(missing)} (or give base: "
                               "a built-in profile to start from: " + ", ".join(BUILTIN) + ")")
        try:
            return cls(**fields)
        except ProfileError as exc:
            raise ProfileError(str(exc).replace("NodeProfile.", f"{source}.", 1)) from None

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def save(self, path: str) -> None:
        """Write the profile as YAML (what ``--node PATH`` reads back)."""
        with open(path, "w", encoding="utf-8") as fh:
            fh.write(self.to_yaml())

    @classmethod
    def from_yaml(cls, path: str) -> "NodeProfile":
        """A profile from a YAML file of its fields (``base:`` allowed).

        Raises:
            ProfileError: unreadable file, not YAML, or an invalid field; one line.
        """
        import yaml

        try:
            with open(path, encoding="utf-8") as fh:
                data = yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        except OSError as exc:
            raise ProfileError(f"{path}: cannot read it: {exc.strerror or exc}") from None
        except yaml.YAMLError as exc:
            raise ProfileError(f"{path}: not valid YAML: " + " ".join(str(exc).split())) from None
        return cls.from_dict(data if data is not None else {}, source=str(path))


def _tflops_table(value: Any) -> Tuple[Tuple[int, float], ...]:
    """``gpu_tflops_by_tokens`` as sorted (tokens, TFLOP/s) pairs, or one line on what is wrong."""
    items = list(value.items()) if isinstance(value, Mapping) else value
    allowed = "expected a mapping of tokens per micro-batch (an integer >= 1) to TFLOP/s (> 0)"
    try:
        pairs = [(at, tflops) for at, tflops in items]
    except (TypeError, ValueError):
        _fail("gpu_tflops_by_tokens", value, allowed)
    if not pairs:
        _fail("gpu_tflops_by_tokens", value, allowed + ", or null")
    for at, tflops in pairs:
        if not _is_int(at) or at < 1 or not _is_number(tflops) \
                or not 0 < tflops < float("inf"):
            _fail("gpu_tflops_by_tokens", value, allowed)
    return tuple(sorted((int(at), float(tflops)) for at, tflops in pairs))


# -- built-in profiles -------------------------------------------------------------------------

_PM1733 = dict(drive_write_gbps=3.8, drive_read_gbps=6.4, drive_tbw_tb=7008.0)
"""A PCIe Gen4 U.2 data-center drive of 3.84 TB (Samsung PM1733 class): 6.4 / 3.8 GB/s
sequential read / write, 1 drive write per day for 5 years (3.84 TB x 365 x 5 = 7,008 TB)."""


def _builtin() -> Dict[str, NodeProfile]:
    def node(name: str, source: str, **fields: Any) -> NodeProfile:
        return NodeProfile(name=name, source=source, **fields)

    profiles = (
        node("a100-80g", "DGX A100 640GB datasheet (8x A100 80GB, 2 TB memory, 8x 3.84 TB Gen4 "
             "NVMe; 2x EPYC 7742: 16 DDR4-3200 channels, 410 GB/s); 150 TFLOP/s: Megatron-LM's A100 runs (Narayanan et al. 2021); "
             "docs/models.md#node-profiles",
             gpus_per_node=8, gpu_memory_bytes=80 * GB, gpu_tflops=150.0,
             host_memory_bytes=150 * GB, host_link_gbps=24.0, drives=8, nvlink_gbps=300.0,
             host_memory_gbps=409.6, gpu_kind="a100-sxm", nics=8, nic_gbps=200.0, **_PM1733),
        node("dgx-h100", "DGX H100 datasheet (8x H100 80GB, 2 TB memory, 8x 3.84 TB NVMe U.2; 2x Xeon "
             "8480C: 16 DDR5-4800 channels, 614 GB/s; 8x ConnectX-7 400 Gb/s for the compute fabric); "
             "400 TFLOP/s: Megatron-Core's reported MFU on H100; docs/models.md#node-profiles",
             gpus_per_node=8, gpu_memory_bytes=80 * GB, gpu_tflops=400.0,
             host_memory_bytes=150 * GB, host_link_gbps=48.0, drives=8, nvlink_gbps=450.0,
             host_memory_gbps=614.4, gpu_kind="h100-sxm", nics=8, nic_gbps=400.0, **_PM1733),
        node("dgx-h200", "DGX H200 datasheet (8x H200 141GB, 2 TB memory, 8x 3.84 TB NVMe U.2; 2x Xeon "
             "8480C: 614 GB/s); "
             "H100's compute; docs/models.md#node-profiles",
             gpus_per_node=8, gpu_memory_bytes=141 * GB, gpu_tflops=420.0,
             host_memory_bytes=150 * GB, host_link_gbps=48.0, drives=8, nvlink_gbps=450.0,
             host_memory_gbps=614.4, gpu_kind="h200", nics=8, nic_gbps=400.0, **_PM1733),
        node("dgx-b200", "DGX B200 datasheet (8x B200 180GB, 2 TB memory, 8x 3.84 TB NVMe U.2; 2x Xeon "
             "8570: 16 DDR5-5600 channels, 717 GB/s); "
             "docs/models.md#node-profiles",
             gpus_per_node=8, gpu_memory_bytes=180 * GB, gpu_tflops=900.0,
             host_memory_bytes=150 * GB, host_link_gbps=48.0, drives=8, nvlink_gbps=900.0,
             host_memory_gbps=716.8, gpu_kind="b200", nics=8, nic_gbps=400.0, **_PM1733),
        node("gh200", "GH200 Grace Hopper superchip (96 GB HBM3, 480 GB LPDDR5X of up to 512 GB/s behind "
             "NVLink-C2C), one per node, two local Gen4 drives assumed; "
             "docs/models.md#node-profiles",
             gpus_per_node=1, gpu_memory_bytes=96 * GB, gpu_tflops=400.0,
             host_memory_bytes=288 * GB, host_link_gbps=300.0, drives=2, nvlink_gbps=450.0,
             host_memory_gbps=512.0, gpu_kind="gh200", nics=1, nic_gbps=400.0, **_PM1733),
        node("cloud-h100", "a cloud 8x H100 80GB instance with 1.8 TB memory and two local "
             "Gen4 NVMe drives (fewer drives than a DGX); docs/models.md#node-profiles",
             gpus_per_node=8, gpu_memory_bytes=80 * GB, gpu_tflops=400.0,
             host_memory_bytes=135 * GB, host_link_gbps=48.0, drives=2, nvlink_gbps=450.0,
             gpu_kind="h100-sxm", nics=8, nic_gbps=400.0, **_PM1733),
    )
    return {p.name: p.replace(cpu_adam_params_per_s=CPU_ADAM_ESTIMATES.get(p.name))
            for p in profiles}


CPU_ADAM_ESTIMATES: Dict[str, float] = {
    "a100-80g": 0.9e9, "dgx-h100": 1.37e9, "dgx-h200": 1.37e9, "dgx-b200": 1.6e9,
    "gh200": 9.1e9, "cloud-h100": 1.37e9}
"""ESTIMATES, not measurements: parameters per second of torch's fused AdamW on the CPU per
GPU's rank, every rank stepping at once (``cpu_adam_params_per_s``). A step reads the fp32
parameter, gradient and both moments and writes back three, 28 B per parameter, so the memory
bus bounds it: DGX H100, 614 GB/s / 28 B / 8 ranks = 2.7e9 per rank; each estimate is half its
node's bound (what a loaded two-socket memory system sustains, pageable memory on either
socket), the cores being no limit (one core of this project's 2-core machine stepped 0.73e9
parameters/s; a DGX H100 gives each rank 14). cloud-h100 (bus not known): the DGX H100's.
``ssdtrain doctor --node-profile`` measures the node's own (docs/models.md, Optimizer
offload)."""


BUILTIN: Dict[str, NodeProfile] = _builtin()
"""The named profiles, by name."""

DEFAULT_NODE = "dgx-h100"
"""The node planned for when nothing names one (``ssdtrain plan`` without --node or a preset's
node: section, and a job's choice of engine without a node: section)."""


def load_profile(name_or_path: Union[str, NodeProfile]) -> NodeProfile:
    """A built-in profile by name (``dgx-h100``), or one read from a YAML file.

    Raises:
        ProfileError: neither a built-in name nor a readable profile file (the message lists
            the built-ins), or an invalid field.
    """
    if isinstance(name_or_path, NodeProfile):
        return name_or_path
    text = str(name_or_path)
    if text in BUILTIN:
        return BUILTIN[text]
    if os.path.isfile(text):
        return NodeProfile.from_yaml(text)
    raise ProfileError(f"{text!r} is neither a built-in node profile ("
                       + ", ".join(BUILTIN) + ") nor a profile file (YAML)")


def profile_from_preset(value: Any, source: str = "node") -> NodeProfile:
    """A preset's ``node:`` section: a profile's name or path, or a mapping of its fields
    (``base: NAME`` and overrides)."""
    if isinstance(value, str):
        try:
            return load_profile(value)
        except ProfileError as exc:
            raise ProfileError(f"{source}: {exc}") from None
    return NodeProfile.from_dict(value, source=source)


def builtin_names() -> Tuple[str, ...]:
    return tuple(BUILTIN)
