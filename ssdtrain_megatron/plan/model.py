"""Analytic model: activation bytes per transformer layer, training FLOPs, required bandwidth.

The byte counts follow what the layers actually hand to autograd (the tensors a
``saved_tensors_hooks`` pack hook sees), one named term per saved tensor, so that the model can
be checked term by term against what the offloader measures. With the paper's assumptions
(:meth:`SaveProfile.paper`: 16-bit activations, 1-byte dropout masks, FFN = 4h, no
recomputation) the terms add up to Korthikanti et al.'s ``s*b*h*(34 + 5*a*s/h)`` bytes per layer:

=========================  ==========  ============================================
term                       16-bit      divided by (TP t, sequence parallel)
=========================  ==========  ============================================
attn_norm_input            2sbh        t only with sequence parallel
qkv_input                  2sbh        t only with sequence parallel
query, key                 4sbh        t
softmax_output             2as^2b      t   (gone with flash attention)
attention_dropout_mask     as^2b       t   (gone with flash attention)
attention_probs            2as^2b      t   (gone with flash attention)
value                      2sbh        t
proj_input                 2sbh        t
attn_residual_dropout_mask sbh         t only with sequence parallel
mlp_norm_input             2sbh        t only with sequence parallel
fc1_input                  2sbh        t only with sequence parallel
activation_input           8sbh        t   (2sbf; SwiGLU: 4sbf fused, three 2sbf unfused)
fc2_input                  8sbh        t   (2sbf)
mlp_residual_dropout_mask  sbh         t only with sequence parallel
=========================  ==========  ============================================

Selective recomputation drops the three attention-score terms (megatron's checkpoint of the
core attention saves query, key and value instead; key and value unexpanded under GQA); full
recomputation keeps only the layer input ``2sbh`` (``/t`` with sequence parallel).

Units: bytes and FLOPs are exact integers; bandwidths are decimal (1 GB/s = 1e9 bytes/s).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

from .shape import _FP32, DTYPE_BYTES, PAPER, RECOMPUTE_GRANULARITIES, ModelShape, SaveProfile

PEAK_MODES = ("keep", "offload", "recompute")

__all__ = [
    "DTYPE_BYTES", "PAPER", "PEAK_MODES", "RECOMPUTE_GRANULARITIES", "ModelShape", "SaveProfile",
    "attention_core_flops", "estimate_step_time_s", "forward_flops_per_layer",
    "head_activation_terms",
    "largest_micro_batch", "layer_activation_bytes", "layer_activation_terms",
    "peak_activation_bytes", "peak_disk_bytes", "required_write_gbps",
    "training_flops_per_micro_batch",
]


def layer_activation_terms(shape: ModelShape, profile: SaveProfile = PAPER, *,
                           include_shared: bool = True) -> Dict[str, int]:
    """Bytes saved for backward by one transformer layer for one micro-batch on one rank.

    One entry per saved tensor, in forward save order; tensors the configuration does not
    save are absent. ``include_shared`` counts tensors every layer saves by reference to one
    object (the causal attention mask); an offloader that deduplicates writes it once, in the
    first layer.
    """
    if shape.cp > 1:
        return _context_parallel_terms(shape, profile, include_shared)
    d = shape.dtype_bytes
    t = shape.tp
    s, b, h = shape.seq_len, shape.micro_batch, shape.hidden
    mask_b = d if profile.dropout_mask_bytes is None else profile.dropout_mask_bytes
    # Norms, dropouts and linear inputs see the whole sequence unless sequence parallel
    # splits it; everything between the column- and row-parallel linears is split by heads.
    sp_tokens = (s // t if shape.sequence_parallel else s) * b
    tokens = s * b
    shared_mask = include_shared and profile.attention_mask and not shape.flash_attention
    terms: Dict[str, int] = {}

    if shape.recompute == "full":
        # megatron's checkpoint saves the layer's arguments: hidden states (and the mask).
        terms["layer_input"] = d * sp_tokens * h
        if shared_mask:
            terms["attention_mask"] = s * s
        return terms

    def norm(prefix: str) -> None:
        terms[f"{prefix}_input"] = d * sp_tokens * h
        if profile.small_fp32_stats:
            terms[f"{prefix}_mean"] = _FP32 * sp_tokens
            terms[f"{prefix}_rstd"] = _FP32 * sp_tokens

    norm("attn_norm")
    terms["qkv_input"] = d * sp_tokens * h
    _attention_terms(terms, shape, profile, shared_mask)
    terms["proj_input"] = d * tokens * shape.query_width // t
    if shape.hidden_dropout > 0:
        terms["attn_residual_dropout_mask"] = mask_b * sp_tokens * h
    norm("mlp_norm")
    if shape.num_experts is not None:
        _moe_terms(terms, shape)
    else:
        _mlp_terms(terms, shape, profile)
    if shape.hidden_dropout > 0:
        terms["mlp_residual_dropout_mask"] = mask_b * sp_tokens * h
    return terms


def local_sequence_shape(shape: ModelShape) -> ModelShape:
    """What one context-parallel rank holds: the same model on seq_len / cp tokens."""
    return dataclasses.replace(shape, seq_len=shape.seq_len // shape.cp, cp=1)


def _context_parallel_terms(shape: ModelShape, profile: SaveProfile,
                            include_shared: bool) -> Dict[str, int]:
    """A context-parallel rank's terms: every tensor holds seq_len / cp tokens, but the
    attention saves keys and values all-gathered over the cp ranks (Transformer Engine's
    all-gather CP; its ring variant saves per-step chunks instead: read these as an upper
    bound there). Modelled, not measured: CP needs TE and two GPUs."""
    terms = layer_activation_terms(local_sequence_shape(shape), profile,
                                   include_shared=include_shared)
    for name in ("key", "value"):
        if name in terms:
            terms[name] *= shape.cp
    return terms


def _mlp_terms(terms: Dict[str, int], shape: ModelShape, profile: SaveProfile) -> None:
    """The dense MLP's saved tensors (fc1, activation, fc2)."""
    d, t, h, f = shape.dtype_bytes, shape.tp, shape.hidden, shape.ffn_hidden
    tokens = shape.seq_len * shape.micro_batch
    sp_tokens = (shape.seq_len // t if shape.sequence_parallel else shape.seq_len) * shape.micro_batch
    terms["fc1_input"] = d * sp_tokens * h
    if shape.swiglu and shape.swiglu_fusion:
        # Megatron's fused SwiGLU saves the whole fc1 output (gate and up halves) once.
        terms["swiglu_input"] = 2 * d * tokens * f // t
    elif shape.swiglu:
        # silu(gate) * up: silu saves its input, the product saves both of its operands. The
        # gate is the first half of every row of the fc1 output: a strided view whose span
        # runs to the last row's gate, almost the whole fc1 output.
        gate = (tokens - 1) * 2 * f // t + f // t if profile.strided_view_span else tokens * f // t
        terms["swiglu_gate_input"] = d * gate
        terms["swiglu_gate_output"] = d * tokens * f // t
        terms["swiglu_up"] = d * tokens * f // t
    else:
        terms["activation_input"] = d * tokens * f // t
    terms["fc2_input"] = d * tokens * f // t


_INT64 = 8


def _moe_terms(terms: Dict[str, int], shape: ModelShape) -> None:
    """A mixture-of-experts MLP: megatron-core's router (softmax top-k, aux loss), the alltoall
    dispatcher, SequentialMLP experts, no capacity factor (no token dropped). Every token goes
    to top-k experts, so the experts see tokens * k rows in all: per rank on average under
    expert parallelism (the split between experts is the router's). Router probabilities are
    fp32, indices int64, the routing map bool (1 byte). Checked at fp32 on the CPU
    (tests/test_plan_vs_megatron.py); under bf16 the expert terms scale with dtype_bytes."""
    d, h, t = shape.dtype_bytes, shape.hidden, shape.tp
    # With TP (megatron requires sequence parallel then) the router sees this rank's part of
    # the sequence; the experts (expert TP = TP) see the whole TP group's rows, f split by t.
    # Not measured: MoE with TP needs the Transformer Engine spec (CUDA).
    tokens = (shape.seq_len // t if shape.sequence_parallel else shape.seq_len) * shape.micro_batch
    experts, k = shape.num_experts, shape.moe_topk
    f = (shape.moe_ffn_hidden or shape.ffn_hidden) // t
    rows = tokens * k
    expert_rows = shape.seq_len * shape.micro_batch * k
    terms["router_input"] = d * tokens * h
    terms["router_scores"] = _FP32 * tokens * experts
    terms["router_topk_probs"] = _FP32 * rows
    terms["router_topk_indices"] = _INT64 * rows
    terms["aux_loss_topk_indices"] = _INT64 * rows
    terms["tokens_per_expert"] = _INT64 * experts
    terms["aux_loss"] = _FP32
    terms["routing_map"] = tokens * experts
    terms["routing_probs"] = _FP32 * tokens * experts
    terms["permutation_indices"] = _INT64 * rows
    terms["expert_fc1_input"] = d * expert_rows * h
    # SwiGLU experts (Mixtral, Qwen3, DeepSeek), fused as megatron-core runs them by default
    # (weighted_bias_swiglu_impl: the probabilities applied inside): the 2f-wide fc1 output and
    # the fp32 probabilities, nothing else. Unfused, about 4f (the gate's strided span, silu's
    # output, the up half plus the offset) and the product the probabilities scale; GeLU
    # experts save the activation's input and its output, which the probabilities scale.
    fused = shape.swiglu and shape.swiglu_fusion
    width = (2 if fused else 4) * f if shape.swiglu else f
    terms["expert_activation_input"] = d * expert_rows * width
    terms["expert_probs"] = _FP32 * expert_rows
    if not fused:
        terms["expert_activation_output"] = d * expert_rows * f
    terms["expert_fc2_input"] = d * expert_rows * f
    # Unpermute scatters with the indices expanded over h (a stride-0 view: its span is
    # what is saved).
    terms["unpermute_indices"] = _INT64 * rows


def _attention_terms(terms: Dict[str, int], shape: ModelShape, profile: SaveProfile,
                     shared_mask: bool) -> None:
    """The core attention's saved tensors, per kind of attention: selective recomputation's
    checkpoint, unfused (scores, softmax, dropout) or flash attention."""
    d, t = shape.dtype_bytes, shape.tp
    s, b, a = shape.seq_len, shape.micro_batch, shape.heads
    mask_b = d if profile.dropout_mask_bytes is None else profile.dropout_mask_bytes
    soft_b = d if profile.softmax_bytes is None else profile.softmax_bytes
    tokens = s * b
    kv_width = shape.groups * shape.head_dim
    q_width = shape.query_width
    unfused = not shape.flash_attention
    if shape.recompute == "selective":
        # The checkpoint of the core attention saves its inputs, before any GQA expansion.
        terms["query"] = d * tokens * q_width // t
        terms["key"] = d * tokens * kv_width // t
        terms["value"] = d * tokens * kv_width // t
        if shared_mask:
            terms["attention_mask"] = s * s
    elif unfused:
        kv_saved = q_width if profile.expand_kv else kv_width
        scores = a * s * s * b // t
        terms["query"] = d * tokens * q_width // t
        terms["key"] = d * tokens * kv_saved // t
        if shared_mask:
            terms["attention_mask"] = s * s
        terms["softmax_output"] = soft_b * scores
        if shape.attention_dropout > 0:
            terms["attention_dropout_mask"] = mask_b * scores
            terms["attention_probs"] = d * scores
        elif soft_b != d:
            terms["attention_probs"] = d * scores  # the cast back to the activation dtype
        elif profile.count_aliased_views:
            terms["attention_probs"] = d * scores  # a view of softmax_output
        terms["value"] = d * tokens * kv_saved // t
    else:
        # Flash attention saves q, k, v, its output (the proj input below, one tensor) and
        # the log-sum-exp of each row.
        terms["query"] = d * tokens * q_width // t
        terms["key"] = d * tokens * kv_width // t
        terms["value"] = d * tokens * kv_width // t
        if profile.count_aliased_views:
            # torch's SDPA saves its output [b, a, s, hd]; the projection saves the [s, b, q]
            # view of it: the same storage, a second record for an offloader keyed by view.
            terms["attention_output"] = d * tokens * q_width // t
        if profile.small_fp32_stats:
            terms["attention_lse"] = _FP32 * b * a * s // t


def layer_activation_bytes(shape: ModelShape, profile: SaveProfile = PAPER, *,
                           min_tensor_bytes: int = 0, include_shared: bool = True) -> int:
    """Sum of :func:`layer_activation_terms`, counting only tensors of at least
    ``min_tensor_bytes`` (the offloader passes smaller ones through)."""
    terms = layer_activation_terms(shape, profile, include_shared=include_shared)
    return sum(v for v in terms.values() if v >= min_tensor_bytes)


def head_activation_terms(shape: ModelShape, profile: SaveProfile = PAPER) -> Dict[str, int]:
    """Bytes saved outside the transformer layers for one micro-batch (embedding dropout,
    final norm, output layer, loss); empty unless ``vocab`` is set. The loss term assumes
    megatron's vocab-parallel cross entropy, which keeps fp32 softmax logits (vocab padded
    up to a multiple of tp)."""
    if shape.vocab is None:
        return {}
    if shape.cp > 1:  # the head sees this rank's seq_len / cp tokens
        return head_activation_terms(local_sequence_shape(shape), profile)
    d, t = shape.dtype_bytes, shape.tp
    s, b, h = shape.seq_len, shape.micro_batch, shape.hidden
    mask_b = d if profile.dropout_mask_bytes is None else profile.dropout_mask_bytes
    sp_tokens = (s // t if shape.sequence_parallel else s) * b
    terms: Dict[str, int] = {}
    if shape.hidden_dropout > 0:
        terms["embedding_dropout_mask"] = mask_b * sp_tokens * h
    terms["final_norm_input"] = d * sp_tokens * h
    if profile.small_fp32_stats:
        terms["final_norm_mean"] = _FP32 * sp_tokens
        terms["final_norm_rstd"] = _FP32 * sp_tokens
    terms["output_layer_input"] = d * sp_tokens * h
    terms["loss_softmax"] = _FP32 * s * b * (-(-shape.vocab // t))
    return terms


# -- compute -----------------------------------------------------------------------------------


def attention_core_flops(shape: ModelShape) -> int:
    """FLOPs of one layer's core attention (scores and attention over values) for one
    micro-batch: 4bs^2q over the full square unfused, half of it with flash attention, whose
    kernels skip the blocks above a causal mask's diagonal (every model planned here is a
    causal GPT); unfused attention computes the whole square and masks it after.
    q = heads x head_dim."""
    full = 4 * shape.micro_batch * shape.seq_len ** 2 * shape.query_width
    return full // 2 if shape.flash_attention else full


def forward_flops_per_layer(shape: ModelShape) -> int:
    """Matmul FLOPs of one layer's forward for one micro-batch, summed over the TP ranks.

    QKV 2sbh(q + 2*g*hd), scores and attention over values (:func:`attention_core_flops`:
    4bs^2q unfused, as megatron's own formula counts it; half with causal flash attention),
    output projection 2sbqh, MLP 4sbhf (6sbhf with SwiGLU),
    where q = heads x head_dim is the query width (h unless kv_channels says otherwise).
    A mixture of experts runs each token through top-k experts of width f_e (k times the MLP
    at f_e) plus the router 2sbhE.
    """
    s, b, h, f = shape.seq_len, shape.micro_batch, shape.hidden, shape.ffn_hidden
    kv_width = shape.groups * shape.head_dim
    q = shape.query_width
    qkv = 2 * s * b * h * (q + 2 * kv_width)
    attention = attention_core_flops(shape)
    proj = 2 * s * b * q * h
    if shape.num_experts is not None:
        f_e = shape.moe_ffn_hidden or f
        mlp = shape.moe_topk * 2 * s * b * h * f_e * (3 if shape.swiglu else 2) \
            + 2 * s * b * h * shape.num_experts
    else:
        mlp = 2 * s * b * h * f * (3 if shape.swiglu else 2)
    return qkv + attention + proj + mlp


def training_flops_per_micro_batch(shape: ModelShape) -> int:
    """FLOPs of forward + backward (2x forward) for one micro-batch of the whole model, plus
    the recomputed forward (full: every layer; selective: the attention core). For a GPT with
    f = 4h, MHA and GELU this equals megatron's ``72 B s L h^2 (1 + s/6h + V/12hL)``."""
    layer = forward_flops_per_layer(shape)
    head = 2 * shape.seq_len * shape.micro_batch * shape.hidden * (shape.vocab or 0)
    total = 3 * (shape.num_layers * layer + head)
    if shape.recompute == "full":
        total += shape.num_layers * layer
    elif shape.recompute == "selective":
        total += shape.num_layers * attention_core_flops(shape)
    return total


def estimate_step_time_s(shape: ModelShape, sustained_tflops: float,
                         num_micro_batches: int = 1) -> float:
    """Seconds per training step on one GPU: the step's FLOPs split over tp * pp * cp GPUs at a
    sustained ``sustained_tflops`` (1e12 FLOP/s); pipeline bubbles are not counted."""
    if not sustained_tflops > 0:
        raise ValueError(f"sustained_tflops={sustained_tflops!r} is invalid: expected > 0")
    flops = training_flops_per_micro_batch(shape) * num_micro_batches
    return flops / (shape.tp * shape.pp * shape.cp) / (sustained_tflops * 1e12)


def required_write_gbps(offloaded_bytes_per_step: float, step_time_s: float) -> float:
    """Write bandwidth (GB/s, 1e9 bytes/s) that hides the offload: the step's offloaded bytes
    must be written while half the step runs (the paper's Sec. III-D)."""
    if not step_time_s > 0:
        raise ValueError(f"step_time_s={step_time_s!r} is invalid: expected > 0")
    return offloaded_bytes_per_step / (step_time_s / 2) / 1e9


# -- memory per mode ---------------------------------------------------------------------------


def peak_activation_bytes(shape: ModelShape, mode: str, profile: SaveProfile = PAPER, *,
                          kept_layers: int = 1, resident_bytes: Optional[int] = None,
                          deferred_bytes: Optional[int] = None) -> int:
    """Peak activation bytes on one GPU of the first pipeline stage (which holds pp
    micro-batches in flight under 1F1B).

    keep:      every layer of every in-flight micro-batch, with ``shape.recompute`` as given.
    offload:   what one micro-batch keeps (``kept_layers`` last layers, or, when given, a
               plan's ``resident_bytes``), plus one layer being written or read back. Of
               that, the last layers (``deferred_bytes``; default: all of it) stay only for
               the micro-batch about to run backward: the offloader writes them once another
               micro-batch's forward starts. Everything else a plan keeps (layers kept for
               bandwidth, recomputed layers' inputs) stays for each of the pp in-flight
               micro-batches.
    recompute: full recomputation: each layer's input for every in-flight micro-batch, plus
               one layer re-created during its backward.
    Layers outside the transformer (``vocab``) are added in every mode.
    """
    if mode not in PEAK_MODES:
        raise ValueError(f"mode={mode!r} is invalid: allowed: " + ", ".join(PEAK_MODES))
    head = sum(head_activation_terms(shape, profile).values())
    layer = layer_activation_bytes(shape, profile)
    if mode == "keep":
        return shape.pp * shape.layers_per_stage * layer + head
    if mode == "offload":
        if resident_bytes is None:
            resident_bytes = min(kept_layers, shape.layers_per_stage) * layer
        deferred = resident_bytes if deferred_bytes is None else min(deferred_bytes, resident_bytes)
        return shape.pp * (resident_bytes - deferred) + deferred + layer + head
    full = shape.replace(recompute="full")
    unrecomputed = layer_activation_bytes(shape.replace(recompute="none"), profile)
    return shape.pp * shape.layers_per_stage * layer_activation_bytes(full, profile) \
        + unrecomputed + head


def peak_disk_bytes(shape: ModelShape, keep_last_layers: int, profile: SaveProfile = PAPER) -> int:
    """The most activation bytes one GPU of the first pipeline stage has on its drives at once
    under full offload: each of the pp micro-batches in flight (1F1B) has every layer of the
    stage written but for the last ``keep_last_layers`` of the one whose backward comes next
    (the others' last layers are written too, once another forward starts: cache/offloader.py).
    What the launcher's pre-flight holds against a drive's free space; an upper bound for
    plans that keep or recompute layers."""
    layer = layer_activation_bytes(shape, profile)
    kept = min(max(keep_last_layers, 0), shape.layers_per_stage)
    return (shape.pp * shape.layers_per_stage - kept) * layer


def largest_micro_batch(fits: Callable[[int], bool], limit: int = 1 << 16) -> int:
    """Largest b in [1, limit] with ``fits(b)`` true, for a ``fits`` that is true up to some
    b and false beyond it; 0 when even b = 1 does not fit."""
    if not fits(1):
        return 0
    low, high = 1, 2
    while high <= limit and fits(high):
        low, high = high, high * 2
    high = min(high, limit + 1)
    while high - low > 1:  # fits(low) holds, fits(high) does not (or high is past the limit)
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low
