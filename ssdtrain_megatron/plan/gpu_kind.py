"""What one GPU kind does with a GEMM, an attention kernel and a memory-bound pass: the rates
the planner's time terms (plan/step_time.py) divide work by.

Each kind holds its datasheet figures (peak dense tensor-core TFLOP/s in BF16 and FP8, SMs,
HBM GB/s) and the fraction of them real kernels reach. The fractions are general, one per
kind of kernel, never per model or per published run:

* GEMM: ``gemm_efficiency`` of the precision's peak on large shapes, times the wave
  quantization of the shape (:func:`wave_efficiency`: a GEMM of T output tiles on S SMs runs
  ceil(T / S) waves, the last one partly idle). cuBLAS on an H100 SXM reaches about 700-760
  BF16 TFLOP/s on 8192^3 (0.71-0.77 of 989); its FP8 GEMMs about 1,170-1,600 (torch._scaled_mm
  to cuBLASLt's best, 0.59-0.81 of 1,979; a cuBLASLt FP8 cross-check report, 2026-05). The
  planner takes 0.72 and 0.62: Transformer Engine runs its own GEMM shapes, not 8192^3.
* attention: causal flash attention (FlashAttention-3, Shah et al. 2024, its H100 causal
  head-dim-128 figures; cuDNN's fused attention that Transformer Engine runs is on par):
  forward up to about 0.65 of BF16 peak, backward (five matmuls to the forward's two: 2.5x
  its FLOPs) about 0.48, each rising with the keys one kernel call sees as L / (L + 512)
  (:func:`attention_rate`: about half the rate at 512 keys, 0.94 of it at 8k). Context
  parallelism's ring calls the kernel on s / (2 cp) keys at a time (its load-balanced
  chunks). Attention stays in BF16 under Transformer Engine's FP8 recipes (no
  ``--fp8-dot-product-attention``).
* memory-bound passes (norms, activations, residual adds, casts, permutes): 0.85 of HBM GB/s.

A node profile may measure its own (``gemm_efficiency``: NodeProfile) and replace the kind's.

A measured table replaces both the efficiency and the waves (``gemm_tflops_by_shape``:
NodeProfile; ``ssdtrain doctor --node-profile`` sweeps torch matmuls on a GPU): a GEMM runs at
the rate measured at the nearest shape (:func:`nearest_measured`). "Nearest" is simple and
stated: among the rows of the GEMM's dtype, the least |ln(FLOPs / row's FLOPs)| +
|ln(narrowest dimension / row's narrowest)|, the first such row on a tie; its waves and tile
edges are in its measured rate. A table without the dtype's rows (no FP8 where
torch._scaled_mm did not run) leaves that dtype to the kind's efficiency and waves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

MeasuredRow = Tuple[int, int, int, str, float]
"""One measured GEMM: (m, n, k, dtype, TFLOP/s) (NodeProfile.gemm_tflops_by_shape)."""

#: Rows x columns of one output tile of the Hopper/Blackwell BF16/FP8 GEMM kernels cuBLAS and
#: CUTLASS pick for large training GEMMs (128 x 256 warp-specialized tiles).
TILE_M, TILE_N = 128, 256


@dataclass(frozen=True)
class GpuKind:
    """One GPU kind's datasheet rates and the fractions kernels reach (module docstring)."""

    name: str
    bf16_tflops: float
    """Peak dense BF16 tensor-core TFLOP/s (datasheet, no sparsity)."""
    fp8_tflops: Optional[float]
    """Peak dense FP8 TFLOP/s; None: no FP8 tensor cores (FP8 runs as BF16)."""
    sms: int
    """Streaming multiprocessors: the tiles of one GEMM wave."""
    hbm_gbps: float
    """HBM GB/s (1e9 bytes/s)."""
    source: str
    gemm_efficiency: float = 0.72
    """Of the BF16 peak on large GEMMs (module docstring)."""
    fp8_gemm_efficiency: float = 0.62
    """Of the FP8 peak on large GEMMs."""
    attention_forward_efficiency: float = 0.65
    """Causal flash attention forward on long sequences, of the BF16 peak."""
    attention_backward_efficiency: float = 0.48
    """Causal flash attention backward (2.5x the forward's FLOPs), of the BF16 peak."""
    memory_efficiency: float = 0.85
    """Memory-bound passes, of HBM GB/s."""

    def gemm_flops(self, precision: str) -> float:
        """FLOP/s of a large GEMM in ``precision`` ('bf16' or 'fp8')."""
        if precision == "fp8" and self.fp8_tflops is not None:
            return self.fp8_tflops * self.fp8_gemm_efficiency * 1e12
        return self.bf16_tflops * self.gemm_efficiency * 1e12

    def describe(self) -> str:
        fp8 = (f", FP8 {self.fp8_tflops:g} x {self.fp8_gemm_efficiency:g}"
               if self.fp8_tflops else ", no FP8")
        return (f"{self.name}: GEMM BF16 {self.bf16_tflops:g} x {self.gemm_efficiency:g}{fp8} "
                f"TFLOP/s by wave over {self.sms} SMs; attention {self.attention_forward_efficiency:g}"
                f" / {self.attention_backward_efficiency:g} of BF16 peak (fwd / bwd); memory-bound "
                f"{self.hbm_gbps:g} GB/s x {self.memory_efficiency:g}")


def wave_efficiency(m: int, n: int, sms: int) -> float:
    """The busy fraction of a GEMM's waves: ceil(m / 128) x ceil(n / 256) output tiles over
    ``sms`` SMs run in ceil(tiles / sms) waves; the last one is partly idle, and so are the
    tiles' own padded edges (m or n not a multiple of the tile)."""
    tiles_m, tiles_n = -(-m // TILE_M), -(-n // TILE_N)
    tiles = tiles_m * tiles_n
    waves = -(-tiles // sms)
    return (m * n) / (waves * sms * TILE_M * TILE_N)


def gemm_seconds(kind: GpuKind, m: int, n: int, k: int, precision: str = "bf16",
                 efficiency: Optional[float] = None) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM on ``kind``: 2mnk FLOPs at the precision's rate,
    over the wave quantization of its m x n output; ``efficiency`` replaces the kind's large-
    GEMM fraction (a measured profile)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    rate = kind.gemm_flops(precision)
    if efficiency is not None:
        peak = kind.fp8_tflops if precision == "fp8" and kind.fp8_tflops else kind.bf16_tflops
        rate = peak * efficiency * 1e12
    return 2 * m * n * k / (rate * wave_efficiency(m, n, kind.sms))


def nearest_measured(table: Optional[Sequence[MeasuredRow]], m: int, n: int, k: int,
                     precision: str) -> Optional[MeasuredRow]:
    """The row of ``table`` ((m, n, k, dtype, tflops) tuples: NodeProfile.gemm_tflops_by_shape)
    nearest to an (m, n, k) GEMM in ``precision`` (module docstring), or None where the table
    has no row of that dtype."""
    flops, narrow = math.log(m * n * k), math.log(min(m, n, k))
    best, best_d = None, float("inf")
    for row in table or ():
        if row[3] != precision:
            continue
        d = abs(flops - math.log(row[0] * row[1] * row[2])) + abs(narrow - math.log(min(row[:3])))
        if d < best_d:
            best, best_d = row, d
    return best


def measured_gemm_seconds(table: Optional[Sequence[MeasuredRow]], m: int, n: int, k: int, precision: str = "bf16") -> Optional[float]:
    """Seconds of one (m x k) @ (k x n) GEMM at the TFLOP/s measured at the nearest shape of
    its dtype in ``table``; None where the table has no row of that dtype."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    row = nearest_measured(table, m, n, k, precision)
    if row is None:
        return None
    return 2 * m * n * k / (row[4] * 1e12)


#: Keys per kernel call at which flash attention runs at half its long-sequence rate.
ATTENTION_HALF_RATE_KEYS = 512


def attention_rate(kind: GpuKind, keys: int, backward: bool = False) -> float:
    """FLOP/s of causal flash attention whose kernel calls each see ``keys`` keys (module
    docstring)."""
    eff = kind.attention_backward_efficiency if backward else kind.attention_forward_efficiency
    return kind.bf16_tflops * 1e12 * eff * keys / (keys + ATTENTION_HALF_RATE_KEYS)


def memory_seconds(kind: GpuKind, nbytes: float) -> float:
    """Seconds of a memory-bound pass that reads and writes ``nbytes`` in all."""
    return nbytes / (kind.hbm_gbps * 1e9 * kind.memory_efficiency)


KINDS: Dict[str, GpuKind] = {k.name: k for k in (
    GpuKind("h100-sxm", 989.4, 1978.9, 132, 3350.0, "NVIDIA H100 SXM5 80GB datasheet"),
    GpuKind("h200", 989.4, 1978.9, 132, 4800.0, "NVIDIA H200 SXM 141GB datasheet"),
    GpuKind("gh200", 989.4, 1978.9, 132, 4000.0, "NVIDIA GH200 Grace Hopper datasheet (96GB HBM3)"),
    GpuKind("a100-sxm", 312.0, None, 108, 2039.0, "NVIDIA A100 SXM4 80GB datasheet"),
    GpuKind("b200", 2250.0, 4500.0, 148, 8000.0, "NVIDIA DGX B200 datasheet (per GPU)"),
)}
"""The GPU kinds a node profile may name (``gpu_kind``)."""


def gpu_kind(name: str) -> GpuKind:
    """The kind called ``name``.

    Raises:
        ValueError: not a known kind (the message lists them)."""
    try:
        return KINDS[name]
    except KeyError:
        raise ValueError(f"gpu_kind={name!r} is invalid: allowed: " + ", ".join(KINDS)) from None


__all__ = ["ATTENTION_HALF_RATE_KEYS", "GpuKind", "KINDS", "attention_rate", "gemm_seconds", "gpu_kind",
           "measured_gemm_seconds", "memory_seconds", "nearest_measured", "wave_efficiency"]
