"""Published H100 Megatron runs the planner is held against, and the error it has on them.

Each run is a Megatron command line (the layout, batch and flags its recipe names) with the
tokens/s per GPU NVIDIA published for it and the source. ``tests/test_published_runs.py`` plans
each with ``ssdtrain plan --node dgx-h100 --gpus N --json -- ARGS`` and holds the planner within
15% of it, and recomputes :data:`MODEL_ERROR` from them: the figure the plan's assumptions line
and the README state, and the band within which a gain of offload is "within the model's
error" (:func:`beyond_error`). Only figures are cited here (tokens/s per GPU, GPUs, batch and
layout, as each source's table gives them), never their text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Tuple


@dataclass(frozen=True)
class PublishedRun:
    """One published run: its command line, GPUs and tokens/s per GPU, with its source."""

    name: str
    gpus: int
    tokens_per_s_per_gpu: float
    source: str
    argv: Tuple[str, ...]
    missing: str = ""
    """Where the planner cannot come within 15% with its general terms: the term it lacks
    (the run is then left out of :data:`MODEL_ERROR`)."""


def _llama(layers: int, hidden: int, heads: int, ffn: int) -> Tuple[str, ...]:
    """Llama 3's shape as Megatron's flags (GQA 8 groups, SwiGLU, RMSNorm, RoPE, no bias,
    128,256 tokens, 8k sequences, no dropout), with the recipes' data-parallel settings."""
    return ("--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads",
            str(heads), "--ffn-hidden-size", str(ffn), "--group-query-attention",
            "--num-query-groups", "8", "--seq-length", "8192", "--max-position-embeddings", "8192",
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16",
            "--vocab-size", "128256", "--attention-dropout", "0", "--hidden-dropout", "0",
            "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--grad-reduce-in-bf16")


def _layout(tp: int, pp: int, cp: int, b: int, gbs: int, *more: str) -> Tuple[str, ...]:
    flags = ("--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
             "--context-parallel-size", str(cp), "--micro-batch-size", str(b),
             "--global-batch-size", str(gbs))
    if tp > 1:
        flags += ("--sequence-parallel", "--tp-comm-overlap")
    return flags + more


_FP8 = ("--fp8-format", "hybrid")
_FP8_CS = ("--fp8-format", "e4m3", "--fp8-recipe", "tensorwise")
_8B = _llama(32, 4096, 32, 14336)
_70B = _llama(80, 8192, 64, 28672)
_DGXC = "NVIDIA/dgxc-benchmarking llama3.1"
_BRIDGE = "Megatron-Bridge performance summary"

_QWEN3_30B_A3B = (
    "--num-layers", "48", "--hidden-size", "2048", "--num-attention-heads", "32",
    "--group-query-attention", "--num-query-groups", "4", "--kv-channels", "128",
    "--ffn-hidden-size", "6144", "--num-experts", "128", "--moe-router-topk", "8",
    "--moe-ffn-hidden-size", "768", "--moe-grouped-gemm", "--moe-token-dispatcher-type",
    "alltoall", "--seq-length", "4096", "--max-position-embeddings", "4096", "--swiglu",
    "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
    "--bf16", "--vocab-size", "151936", "--attention-dropout", "0", "--hidden-dropout", "0",
    "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--grad-reduce-in-bf16")

PUBLISHED_RUNS: Tuple[PublishedRun, ...] = (
    # 10,153 tokens/s/GPU: dgxc-benchmarking llama3.1 README_8b.md (NeMo 24.09), 8x H100,
    # BF16, TP1 PP1 CP2, MBS 1, GBS 128, 8k
    PublishedRun("Llama 3.1 8B BF16 TP1 PP1 CP2", 8, 10153, f"{_DGXC} README_8b.md (NeMo 24.09)",
                 _8B + _layout(1, 1, 2, 1, 128)),
    # 13,555: the same README and layout, FP8
    PublishedRun("Llama 3.1 8B FP8 TP1 PP1 CP2", 8, 13555, f"{_DGXC} README_8b.md (NeMo 24.09)",
                 _8B + _layout(1, 1, 2, 1, 128) + _FP8),
    # 1,113: README_70b.md (NeMo 24.09), 64x H100, BF16, TP4 PP4 CP2 VP5, MBS 1, GBS 128
    PublishedRun("Llama 3.1 70B BF16 TP4 PP4 CP2 VP5", 64, 1113,
                 f"{_DGXC} README_70b.md (NeMo 24.09)",
                 _70B + _layout(4, 4, 2, 1, 128, "--num-layers-per-virtual-pipeline-stage", "4")),
    # 1,524: NeMo 24.12 performance summary, Llama 3 70B FP8, the same layout
    PublishedRun("Llama 3 70B FP8 TP4 PP4 CP2 VP5", 64, 1524, "NeMo 24.12 performance summary",
                 _70B + _layout(4, 4, 2, 1, 128, "--num-layers-per-virtual-pipeline-stage", "4")
                 + _FP8),
    # 1,602: Megatron-Bridge 25.11 summary, DGX-H100, LLAMA3_70B FP8-CS: 64 GPUs, GBS 128,
    # MBS 1, 8192, TP4 PP8 CP1 VP5 (GA 64)
    PublishedRun("Llama 3 70B FP8-CS TP4 PP8 VP5", 64, 1602, f"{_BRIDGE} 25.11, DGX-H100",
                 _70B + _layout(4, 8, 1, 1, 128, "--num-layers-per-virtual-pipeline-stage", "2")
                 + _FP8_CS),
    # 5,275: the same summary, Qwen3_30B_a3B FP8-CS: 16 GPUs, GBS 512, MBS 2, 4096,
    # TP1 PP2 CP1 VP24 EP8 (GA 32), dropless with force-balanced routing
    PublishedRun("Qwen3-30B-A3B FP8-CS PP2 VP24 EP8", 16, 5275, f"{_BRIDGE} 25.11, DGX-H100",
                 _QWEN3_30B_A3B + _layout(1, 2, 1, 2, 512, "--expert-model-parallel-size", "8",
                                          "--num-layers-per-virtual-pipeline-stage", "1")
                 + _FP8_CS,
                 missing="host time of fine-grained MoE: the dropless alltoall dispatcher's "
                         "device-to-host sync of tokens per expert in every layer, after which "
                         "the GPU waits on the CPU launching the layer's many small kernels "
                         "(the same layout with token dropping, 25.09: 10,494, twice as fast)"),
    # Checks beside the table:
    # 14,451: Bridge 25.11, DGX-H100, LLAMA3_8B FP8-CS: 8 GPUs, GBS 128, MBS 1, TP1 PP1 CP1
    # (FSDP there; the distributed optimizer here)
    PublishedRun("Llama 3 8B FP8-CS TP1 PP1", 8, 14451, f"{_BRIDGE} 25.11, DGX-H100",
                 _8B + _layout(1, 1, 1, 1, 128) + _FP8_CS),
    # 1,621: Bridge 26.02 (archive), DGX-H100, LLAMA3_70B FP8: 64 GPUs, GBS 256, MBS 1,
    # TP4 PP8 CP1 VP5
    PublishedRun("Llama 3 70B FP8 TP4 PP8 VP5 GBS 256", 64, 1621, f"{_BRIDGE} 26.02, DGX-H100",
                 _70B + _layout(4, 8, 1, 1, 256, "--num-layers-per-virtual-pipeline-stage", "2")
                 + _FP8_CS),
)


@dataclass(frozen=True)
class ModelError:
    """The planner over the published runs it models (planner / published - 1)."""

    median: float
    low: float
    high: float
    runs: int

    @property
    def spread(self) -> float:
        """high - low: the scatter from run to run, which a ratio of two of the planner's own
        figures (a gain) does not cancel, unlike the median's common bias."""
        return self.high - self.low

    def line(self) -> str:
        return (f"the model's error over {self.runs} published H100 Megatron runs: median "
                f"{self.median:+.1%}, from {self.low:+.1%} to {self.high:+.1%} (docs/models.md)")


MODEL_ERROR = ModelError(median=0.052, low=0.032, high=0.133, runs=7)
"""Measured by tests/test_published_runs.py on :data:`PUBLISHED_RUNS` (those without
``missing``); the test fails when the terms move it."""


def beyond_error(gain: float, error: ModelError = MODEL_ERROR) -> bool:
    """Whether a modelled gain (best with offload over best without) exceeds the model's
    scatter: only then is "offload pays" said; otherwise "within the model's error"."""
    return gain - 1 > error.spread


def assumed_terms(node: Mapping[str, Any]) -> Tuple[str, str]:
    """(compute, communication) words for the plan's assumptions line from a node profile's
    dict: its GPU kind's terms and the model's measured error, or ("", what a node without a
    kind leaves out)."""
    kind = node.get("gpu_kind")
    if not kind or node.get("gpu_tflops_by_tokens"):
        return "", ("no data-parallel or pipeline communication, no expert all-to-all (a node "
                    "without gpu_kind: one rate for every FLOP)")
    from .gpu_kind import gpu_kind

    from .step_time import gemm_source

    compute = f"{gpu_kind(kind).describe()}; {gemm_source(node)}"
    nics = (f"{node['nics']} x {node['nic_gbps']:g} Gb/s NICs per node" if node.get("nics")
            else "NICs not known (NVLink's rate assumed)")
    comm = ("TP, CP and expert all-to-all over NVLink, data-parallel reduce-scatter and "
            f"all-gather and pipeline sends over NVLink within a node or {nics}, overlapped as "
            "the job's flags say; the (interleaved) pipeline bubble; " + MODEL_ERROR.line())
    return compute, comm


__all__ = ["assumed_terms", "MODEL_ERROR", "ModelError", "PUBLISHED_RUNS", "PublishedRun", "beyond_error"]
