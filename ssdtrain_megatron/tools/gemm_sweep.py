"""`ssdtrain doctor --node-profile`'s GEMM sweep: torch matmuls timed on the GPU at the shapes
Megatron's layers run, written into the profile as ``gemm_tflops_by_shape`` (plan/node.py),
which the planner's time terms read instead of the GPU kind's efficiency and waves
(plan/step_time.py, plan/gpu_kind.py ``nearest_measured``).

The shapes (:data:`SHAPES`): the (M tokens, N, K) of the GEMMs plan/step_time.py prices for
Llama-style layers on one rank: QKV, projection, fc1 (SwiGLU: twice the FFN width) and fc2 of
a Llama 3 8B layer at TP1 and of a 70B layer at TP4, at 2,048 and 8,192 tokens; and narrow
expert GEMMs (a Qwen3-30B-A3B expert: hidden 2,048, FFN 768) at 512, 2,048 and 8,192 rows.
With ``doctor --config PRESET`` the job's own shapes (:func:`job_shapes`) are swept first.
Each in BF16 (torch.mm) and, where torch._scaled_mm runs on the card, FP8 (e4m3 inputs,
per-tensor scales, BF16 output).

Bounded: each shape is warmed up (:data:`WARMUP` calls) and timed over :data:`TIMED` calls
between two CUDA events, after a synchronize; the sweep stops at :data:`BUDGET_S` seconds and
says which shapes it left out (about 116 TFLOP per dtype in all, warm-up included: estimated at
a second or two on an H100, not yet measured). It runs on a CUDA device only: on a CPU it is
skipped and doctor says why.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

log = logging.getLogger(__name__)

WARMUP = 3
TIMED = 10
BUDGET_S = 10.0
"""The sweep stops starting shapes after this many seconds."""


def _layer(tokens: int, hidden: int, q: int, kv: int, ffn: int, tp: int) -> List[Tuple[int, int, int]]:
    """(M, N, K) of a Llama-style layer's QKV, projection, SwiGLU fc1 and fc2 on one tp rank."""
    return [(tokens, (q + 2 * kv) // tp, hidden), (tokens, hidden, q // tp),
            (tokens, 2 * ffn // tp, hidden), (tokens, hidden, ffn // tp)]


SHAPES: Tuple[Tuple[int, int, int], ...] = tuple(
    [s for t in (2048, 8192) for s in _layer(t, 4096, 4096, 1024, 14336, 1)]       # 8B, TP1
    + [s for t in (2048, 8192) for s in _layer(t, 8192, 8192, 1024, 28672, 4)]     # 70B, TP4
    + [s for rows in (512, 2048, 8192) for s in ((rows, 2 * 768, 2048), (rows, 2048, 768))])
"""The (M, N, K) swept (module docstring)."""

DTYPES = ("bf16", "fp8")


def job_shapes(preset: str) -> List[Tuple[int, int, int]]:
    """The (M, N, K) the planner prices for the job of the preset at ``preset`` (its model on
    its layout: plan/step_time.py ``layer_gemms`` and the output layer; a grouped expert GEMM
    as one of the experts' stacked rows, as the lookup takes it), each once; [] for a preset
    without a model.

    Raises:
        ValueError: an unreadable or invalid preset (one line naming it)."""
    from ..plan.preset_file import read_preset
    from ..plan.step_time import layer_gemms, local_tokens

    shape = read_preset(preset).shape()
    if shape is None:
        return []
    out: List[Tuple[int, int, int]] = []
    for g in layer_gemms(shape):
        m = g.count * g.m if g.grouped and g.count > 1 else g.m
        out.append((m, g.n, g.k))
    if shape.vocab:
        out.append((local_tokens(shape), -(-shape.vocab // shape.tp), shape.hidden))
    return list(dict.fromkeys(s for s in out if min(s) >= 1))

Timer = Callable[[int, int, int, str], Optional[float]]
"""Seconds of one (m x k) @ (k x n) matmul in a dtype, or None where the dtype cannot run."""


def sweep(timer: Timer, shapes: Sequence[Tuple[int, int, int]] = SHAPES,
          dtypes: Sequence[str] = DTYPES, budget_s: float = BUDGET_S,
          clock: Callable[[], float] = time.monotonic) -> Tuple[List[Dict[str, object]], List[str]]:
    """The measured table (rows ``{m, n, k, dtype, tflops}``: NodeProfile.gemm_tflops_by_shape)
    and notes on what was left out: a dtype the timer cannot run (None) is not tried again;
    shapes not started within ``budget_s`` are left out."""
    rows: List[Dict[str, object]] = []
    notes: List[str] = []
    start = clock()
    dropped = set()
    for i, (m, n, k) in enumerate(shapes):
        if clock() - start > budget_s:
            notes.append(f"stopped after {budget_s:g} s: {len(shapes) - i} of {len(shapes)} shapes not measured")
            break
        for dtype in dtypes:
            if dtype in dropped:
                continue
            seconds = timer(m, n, k, dtype)
            if seconds is None:
                dropped.add(dtype)
                notes.append(f"{dtype} not measured: it does not run on this GPU")
                continue
            rows.append({"m": m, "n": n, "k": k, "dtype": dtype,
                         "tflops": round(2 * m * n * k / seconds / 1e12, 1)})
    return rows, notes


def cuda_timer(device: str = "cuda:0") -> Timer:
    """A :data:`Timer` of torch matmuls on ``device``: warm-up, then TIMED calls between two
    CUDA events, synchronized. FP8 is torch._scaled_mm; None where it raises (no FP8 tensor
    cores, or a torch without it)."""
    import torch

    def timed(run: Callable[[], object]) -> float:
        for _ in range(WARMUP):
            run()
        torch.cuda.synchronize(device)
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(TIMED):
            run()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / TIMED

    def timer(m: int, n: int, k: int, dtype: str) -> Optional[float]:
        a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
        if dtype == "bf16":
            return timed(lambda: torch.mm(a, b))
        try:
            fa = a.to(torch.float8_e4m3fn)
            fb = b.t().contiguous().to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
            one = torch.ones((), device=device, dtype=torch.float32)
            return timed(lambda: torch._scaled_mm(fa, fb, scale_a=one, scale_b=one,
                                                  out_dtype=torch.bfloat16))
        except (RuntimeError, AttributeError, TypeError) as exc:
            log.info("FP8 matmul does not run here: %s", exc)
            return None

    return timer


def measure_gemm_table(timer: Optional[Timer] = None, first: Sequence[Tuple[int, int, int]] = ()
                       ) -> Tuple[Optional[List[Dict[str, object]]], str]:
    """(the table, a note for the profile's source): on a CUDA device the sweep (``timer``:
    :func:`cuda_timer` unless given) of ``first`` (the job's shapes: :func:`job_shapes`) and
    then :data:`SHAPES`; on a CPU (None, why it was skipped)."""
    if timer is None:
        import torch

        if not torch.cuda.is_available():
            return None, ("skipped the GEMM sweep (gemm_tflops_by_shape): no CUDA device "
                          "(torch.cuda.is_available() is False); it times GPU matmuls only")
        timer = cuda_timer()
    began = time.monotonic()
    shapes = list(dict.fromkeys(list(first) + list(SHAPES)))
    rows, notes = sweep(timer, shapes)
    took = time.monotonic() - began
    job = f", the job's {len(first)} first" if first else ""
    words = (f"gemm_tflops_by_shape: {len(rows)} torch matmuls at Megatron layers' shapes{job}, in "
             f"{took:.1f} s (tools/gemm_sweep.py)" + "".join(f"; {n}" for n in notes))
    return (rows or None), words


__all__ = ["BUDGET_S", "DTYPES", "SHAPES", "TIMED", "Timer", "WARMUP", "cuda_timer", "job_shapes",
           "measure_gemm_table", "sweep"]
