"""The compute-bound shape's regime, floor and bound on each lent card (no torch: the dry run
prints them anywhere, `GPU_CHECK_DRY=1 make gpu-perf`).

SSDTrain's claim is for a layer whose forward and backward take longer than its saved bytes'
trip over the link. With one micro-batch a step, every offloaded byte is written before the
first one is read back (the reads go last layer first, the writes in order: the first read
waits for the last write), so the link's term is *serialized*: W / D2H + R / H2D. The shape is
in the regime when forward + backward exceeds that by REGIME_MARGIN at the card's rates.

What keep's step also carries, which offload cannot touch: the fused Adam step over every
parameter (memory-bound: OPTIMIZER_BYTES_PER_PARAM of traffic a parameter at the card's
memory bandwidth) and zero_grad (the gradient buffer written). So the step's bound is

    bound = optimizer + zero_grad + max(forward + backward, serialized link)

and the activation-peak floor, against keep's peak (every layer's bytes and the largest
weight-gradient temporary, fc1's or fc2's 4h x h in bf16, which both carry), is

    floor = (kept + max(forward-side layers not yet landed, backward's read window)) x layer
            + the weight-gradient temporary

where the forward side is what forward has made faster than the link took it to host (a layer
made every ``forward`` seconds, copied in ``layer / D2H``, within the in-flight byte cap) and
the read window is plan/readahead.py's (gpu_perf_plan.peak_floor).
"""

from __future__ import annotations

from typing import Dict, List

from .gpu_check_plan import CARDS, activation_bytes, parameters
from .gpu_perf_plan import KEEP_LAST_LAYERS, READAHEAD_CAP, layer_flop, peak_floor

REGIME_MARGIN = 0.15
"""Forward + backward at least this much above the serialized link term, at each card's rates."""
OPTIMIZER_BYTES_PER_PARAM = 14
"""Fused Adam's traffic a parameter: the bf16 weight read and written (4), its gradient read (2),
the two bf16 moments read and written (8); about 103 GB at 7.35 B parameters."""
ZERO_GRAD_BYTES_PER_PARAM = 2
"""zero_grad writes the bf16 gradient buffer."""
CARD_RATES: Dict[str, Dict[str, float]] = {
    "H100 80 GB": {"flops": 500e12, "link_bps": 50e9, "hbm_bps": 2.9e12},
    "H200 141 GB": {"flops": 500e12, "link_bps": 50e9, "hbm_bps": 4.5e12},
}
"""Each lent card's rates in practice: the same sm90 matmul rate and PCIe Gen5 link, and the
memory bandwidth a streaming kernel (the optimizer) reaches (HBM3 3.35 TB/s, HBM3e 4.8 TB/s
peak: 103 GB of Adam traffic in about 35 and 23 ms)."""
assert set(CARD_RATES) == set(CARDS)


def weight_gradient_bytes(shape: dict) -> int:
    """The largest weight-gradient temporary of a layer's backward: fc1's (or fc2's) 4h x h in bf16."""
    return 2 * 4 * shape["hidden"] * shape["hidden"]


def regime(shape: dict, rates: Dict[str, float]) -> Dict[str, float]:
    """The shape at ``rates`` (flops, link_bps, hbm_bps): seconds of forward + backward, of
    the serialized link, of the optimizer and zero_grad, the bound, the margin (forward +
    backward over the serialized link, less 1), and the peak floor and its parts (layers)."""
    layers = shape["layers"]
    layer = activation_bytes(shape) / layers
    fwd_bwd_layer = layer_flop(shape) / rates["flops"]
    forward = fwd_bwd_layer / 3
    fwd_bwd = layers * fwd_bwd_layer
    offloaded = layers - KEEP_LAST_LAYERS
    serial = 2 * offloaded * layer / rates["link_bps"]
    n = parameters(shape)
    optimizer = OPTIMIZER_BYTES_PER_PARAM * n / rates["hbm_bps"]
    zero_grad = ZERO_GRAD_BYTES_PER_PARAM * n / rates["hbm_bps"]
    copy = layer / rates["link_bps"]
    # The k-th offloaded layer is made at k x forward and its copy queues behind the ones before:
    # when forward ends (layers x forward) the copies that landed are (layers - 1) x forward / copy.
    landed = offloaded if copy <= forward else min(offloaded, (layers - 1) * forward / copy)
    not_landed = min(offloaded - landed, READAHEAD_CAP["memory"] / layer)
    window = peak_floor(layers, layer, rates["link_bps"], 2 * forward, READAHEAD_CAP["memory"])["ahead"]
    temp = weight_gradient_bytes(shape)
    held = KEEP_LAST_LAYERS + max(not_landed, window)
    keep_peak = layers * layer + temp
    return {"forward_backward_s": fwd_bwd, "serial_link_s": serial, "margin": fwd_bwd / serial - 1,
            "optimizer_s": optimizer, "zero_grad_s": zero_grad, "bound_s": optimizer + zero_grad + max(fwd_bwd, serial),
            "layer_bytes": layer, "not_landed": not_landed, "read_ahead": window, "kept": KEEP_LAST_LAYERS,
            "weight_gradient_bytes": temp, "keep_peak_bytes": keep_peak,
            "floor": min(1.0, (held * layer + temp) / keep_peak)}


def card_regimes(shape: dict) -> Dict[str, Dict[str, float]]:
    return {card: regime(shape, rates) for card, rates in CARD_RATES.items()}


def regime_lines(shape: dict) -> List[str]:
    """The dry run's lines: per card, the regime's margin, the bound and the floor."""
    lines = []
    for card, r in card_regimes(shape).items():
        ms = {k: r[k] * 1e3 for k in ("forward_backward_s", "serial_link_s", "optimizer_s", "zero_grad_s", "bound_s")}
        lines.append(
            f"{card}: forward+backward {ms['forward_backward_s']:.1f} ms vs the link's serialized W/D2H + R/H2D "
            f"{ms['serial_link_s']:.1f} ms: margin {r['margin']:+.0%} (needs {REGIME_MARGIN:+.0%}); bound "
            f"{ms['bound_s']:.1f} ms = optimizer {ms['optimizer_s']:.1f} + zero_grad {ms['zero_grad_s']:.1f} + "
            f"max(forward+backward, serialized link); peak floor {r['floor']:.2f} = ({r['kept']} kept + max("
            f"{r['not_landed']:.1f} not landed when forward ends, {r['read_ahead']:.1f} read ahead) x "
            f"{r['layer_bytes'] / 1e6:.0f} MB + the {r['weight_gradient_bytes'] / 1e6:.0f} MB weight-gradient "
            f"temporary) / keep's {r['keep_peak_bytes'] / 1e9:.2f} GB")
    return lines
