"""The planner's view of a model: :class:`ModelShape` (sizes and parallel layout, validated) and
:class:`SaveProfile` (what the layers save for backward, beyond the shape).

Split out of ``model.py`` (which re-exports every name here) so that no module is longer than a
few hundred lines; the analytic model itself (bytes, FLOPs, bandwidth) stays there.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Optional

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RECOMPUTE_GRANULARITIES = ("none", "selective", "full")

#: Bytes per element of the small fp32 statistics (LayerNorm mean/rstd, flash-attention LSE).
_FP32 = 4


def _fail(name: str, value: Any, allowed: str) -> None:
    raise ValueError(f"ModelShape.{name}={value!r} is invalid: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ModelShape:
    """Shape of a GPT/Llama-style transformer and its parallel layout, as the planner sees it.

    Example:
        >>> shape = ModelShape(num_layers=24, hidden=2048, heads=16, ffn_hidden=8192,
        ...                    seq_len=2048, micro_batch=4)
        >>> shape.head_dim
        128
    """

    num_layers: int
    """Transformer layers of the whole model (all pipeline stages)."""

    hidden: int
    """Hidden size h."""

    heads: int
    """Attention heads a (query heads)."""

    ffn_hidden: int
    """FFN intermediate size f (with SwiGLU: the width of each of the two fc1 halves)."""

    seq_len: int
    """Sequence length s."""

    micro_batch: int
    """Micro-batch size b."""

    kv_groups: Optional[int] = None
    """Key/value head groups for grouped-query attention; None means multi-head (= heads)."""

    kv_channels: Optional[int] = None
    """Width of one attention head (megatron's ``--kv-channels``); None: hidden / heads.
    Qwen3's is 128 at hidden 2048 and 32 heads, so its queries are 4096 wide."""

    dtype_bytes: int = 2
    """Bytes per activation element: 2 for bf16/fp16, 4 for fp32."""

    tp: int = 1
    """Tensor-parallel degree t."""

    pp: int = 1
    """Pipeline-parallel degree; each stage holds num_layers / pp layers."""

    sequence_parallel: bool = False
    """Megatron sequence parallelism: norms, dropouts and linear inputs are split over t."""

    flash_attention: bool = False
    """Fused (flash) attention: no s x s score tensors are saved."""

    swiglu: bool = False
    """Gated linear unit with SiLU (Llama) instead of GELU."""

    swiglu_fusion: bool = True
    """Megatron-LM's ``--bias-swiglu-fusion`` (its default; ``--no-bias-swiglu-fusion`` turns
    it off; megatron-core's ``bias_activation_fusion``). Fused, SwiGLU is one autograd function
    that saves its input, the fc1 output (2f wide), once; unfused, ``silu(gate) * up`` saves
    three f-wide tensors (silu's input, its output and the up projection). Only read with
    ``swiglu``."""

    recompute: str = "none"
    """Activation recomputation: 'none', 'selective' (core attention) or 'full' (whole layer)."""

    vocab: Optional[int] = None
    """Vocabulary size; when set, the output layer and loss are counted (FLOPs and memory)."""

    attention_dropout: float = 0.1
    """Dropout on attention probabilities (megatron's default 0.1); 0 saves no mask."""

    hidden_dropout: float = 0.1
    """Dropout before each residual add (megatron's default 0.1); 0 saves no mask."""

    num_experts: Optional[int] = None
    """Mixture of experts in every layer (megatron's --num-experts); None: a dense MLP."""

    moe_topk: int = 2
    """Experts each token is routed to (--moe-router-topk). Only read with num_experts."""

    moe_ffn_hidden: Optional[int] = None
    """Each expert's FFN width (--moe-ffn-hidden-size); None: ffn_hidden."""

    cp: int = 1
    """Context-parallel degree (--context-parallel-size): each rank holds seq_len / cp tokens;
    attention (Transformer Engine's, the only one megatron runs CP with) saves the keys and
    values all-gathered over the cp ranks. Needs flash_attention."""

    ep: int = 1
    """Expert-parallel degree (--expert-model-parallel-size): experts split over ep of the
    data-parallel ranks. Per-rank activation bytes do not depend on it (on average each rank's
    experts see as many rows as its own tokens send out); it sets the launch flags."""

    dp: int = 1
    """Data-parallel degree: model replicas. Only the model-state estimate reads it (the
    distributed optimizer shards over dp x cp ranks; expert parameters over dp x cp / ep)."""

    distributed_optimizer: bool = False
    """Megatron's ``--use-distributed-optimizer``: fp32 main parameters and Adam's two states
    sharded over the data-parallel ranks (see ``plan/memory.py``)."""

    main_grad_bytes: int = 4
    """Bytes per element of Megatron's gradient buffer: 4 (fp32, what Megatron runs with bf16:
    ``--accumulate-allreduce-grads-in-fp32`` is set for it), 2 (``--main-grads-dtype bf16``,
    with ``--use-precision-aware-optimizer``). Only the model state reads it."""

    optimizer_offload_fraction: float = 0.0
    """megatron-core's optimizer CPU offload (``--optimizer-cpu-offload``,
    ``--optimizer-offload-fraction F``): the fraction of the optimizer's parameters whose fp32
    main weights and Adam states live in host memory and step on the CPU (plan/memory.py,
    plan/optimizer_offload.py). 0: none."""

    overlap_optimizer_d2h_h2d: bool = False
    """``--overlap-cpu-optimizer-d2h-h2d``: the offloaded part's gradient copies to host, its
    CPU step and its parameter copies back run overlapped (else one after another)."""

    fp8: bool = False
    """The linear layers' GEMMs in FP8 (Megatron's ``--fp8-format``, Transformer Engine):
    the FP8 rate and the casts (plan/step_time.py); attention stays BF16."""

    vp: int = 1
    """Virtual pipeline chunks per stage (``--virtual-pipeline-model-parallel-size``, or
    layers per stage over ``--num-layers-per-virtual-pipeline-stage``): the interleaved 1F1B
    schedule's bubble is (pp - 1) / vp micro-batch times."""

    tp_comm_overlap: bool = False
    """``--tp-comm-overlap``: tensor-parallel collectives overlap the GEMMs they feed."""

    overlap_grad_reduce: bool = False
    """``--overlap-grad-reduce``: the data-parallel gradient reduction overlaps the last
    micro-batch's backward."""

    overlap_param_gather: bool = False
    """``--overlap-param-gather``: the distributed optimizer's parameter all-gather overlaps
    the next step's first forward."""

    grad_reduce_in_bf16: bool = False
    """``--grad-reduce-in-bf16``: gradients are reduced in bf16 (2 bytes) instead of fp32."""

    moe_grouped_gemm: bool = False
    """``--moe-grouped-gemm``: a rank's experts run as one grouped GEMM."""

    fp8_param_gather: bool = False
    """``--fp8-param-gather``: the distributed optimizer all-gathers parameters in FP8 (1 byte)."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "heads", "ffn_hidden", "seq_len", "micro_batch",
                     "tp", "pp", "dp"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                _fail(name, value, "expected an integer >= 1")
        if self.kv_channels is not None and (not _is_int(self.kv_channels) or self.kv_channels < 1):
            _fail("kv_channels", self.kv_channels, "expected an integer >= 1 or null (hidden / heads)")
        if self.kv_groups is not None and (not _is_int(self.kv_groups) or self.kv_groups < 1):
            _fail("kv_groups", self.kv_groups, "expected an integer >= 1 or null (multi-head)")
        if self.dtype_bytes not in (2, 4) or isinstance(self.dtype_bytes, bool):
            _fail("dtype_bytes", self.dtype_bytes, "expected 2 (bf16/fp16) or 4 (fp32)")
        for name in ("sequence_parallel", "flash_attention", "swiglu", "swiglu_fusion",
                     "distributed_optimizer", "fp8", "tp_comm_overlap", "overlap_grad_reduce",
                     "overlap_param_gather", "grad_reduce_in_bf16", "moe_grouped_gemm",
                     "fp8_param_gather"):
            if not isinstance(getattr(self, name), bool):
                _fail(name, getattr(self, name), "expected true or false")
        if self.recompute not in RECOMPUTE_GRANULARITIES:
            _fail("recompute", self.recompute, "allowed: " + ", ".join(RECOMPUTE_GRANULARITIES))
        if not _is_int(self.cp) or self.cp < 1 or self.seq_len % self.cp:
            _fail("cp", self.cp, f"expected an integer >= 1 that divides seq_len ({self.seq_len})")
        if self.cp > 1 and not self.flash_attention:
            _fail("cp", self.cp, "context parallelism needs flash_attention: true (megatron "
                  "runs it with Transformer Engine's fused attention only)")
        if not _is_int(self.ep) or self.ep < 1 or (self.num_experts or 1) % self.ep:
            _fail("ep", self.ep, "expected an integer >= 1 that divides num_experts")
        for name in ("num_experts", "moe_ffn_hidden"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                _fail(name, value, "expected an integer >= 1 or null")
        if not _is_int(self.moe_topk) or not 1 <= self.moe_topk <= (self.num_experts or 1 << 30):
            _fail("moe_topk", self.moe_topk, "expected an integer from 1 to num_experts")
        if self.vocab is not None and (not _is_int(self.vocab) or self.vocab < 1):
            _fail("vocab", self.vocab, "expected an integer >= 1 or null")
        for name in ("attention_dropout", "hidden_dropout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
                _fail(name, value, "expected a probability in [0, 1)")
        if self.kv_channels is None and self.hidden % self.heads:
            _fail("hidden", self.hidden, f"expected a multiple of heads ({self.heads}), or "
                  "kv_channels set")
        if self.heads % self.groups:
            _fail("kv_groups", self.kv_groups, f"expected a divisor of heads ({self.heads})")
        # Megatron replicates key/value heads when groups < tp; that layout is not modelled.
        for name, value in (("heads", self.heads), ("kv_groups", self.groups),
                            ("ffn_hidden", self.ffn_hidden)):
            if value % self.tp:
                _fail(name, value, f"expected a multiple of tp ({self.tp})")
        if self.sequence_parallel and self.seq_len % self.tp:
            _fail("seq_len", self.seq_len,
                  f"expected a multiple of tp ({self.tp}) with sequence_parallel")
        if self.sequence_parallel and self.tp == 1:
            _fail("sequence_parallel", True, "needs tp > 1")
        if self.num_layers % self.pp:
            _fail("num_layers", self.num_layers, f"expected a multiple of pp ({self.pp})")
        if not _is_int(self.vp) or self.vp < 1 or (self.vp > 1 and self.pp == 1) \
                or self.num_layers % (self.pp * self.vp):
            _fail("vp", self.vp, f"expected an integer >= 1 (above 1 only with pp > 1) with "
                  f"num_layers ({self.num_layers}) a multiple of pp x vp")
        self._check_optimizer()

    def _check_optimizer(self) -> None:
        if self.main_grad_bytes not in (2, 4) or isinstance(self.main_grad_bytes, bool):
            _fail("main_grad_bytes", self.main_grad_bytes, "expected 4 (fp32) or 2 (bf16)")
        f = self.optimizer_offload_fraction
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 <= f <= 1:
            _fail("optimizer_offload_fraction", f, "expected a fraction in [0, 1]")
        if f > 0 and not self.distributed_optimizer:
            _fail("optimizer_offload_fraction", f, "needs distributed_optimizer: true (megatron "
                  "runs --optimizer-cpu-offload with --use-precision-aware-optimizer, which "
                  "needs --use-distributed-optimizer)")
        if not isinstance(self.overlap_optimizer_d2h_h2d, bool):
            _fail("overlap_optimizer_d2h_h2d", self.overlap_optimizer_d2h_h2d,
                  "expected true or false")

    # -- derived sizes ------------------------------------------------------------------------

    @property
    def groups(self) -> int:
        """Key/value head groups (heads for multi-head attention)."""
        return self.kv_groups if self.kv_groups is not None else self.heads

    @property
    def head_dim(self) -> int:
        """Width of one attention head: kv_channels, else hidden / heads."""
        return self.kv_channels if self.kv_channels is not None else self.hidden // self.heads

    @property
    def query_width(self) -> int:
        """Width of the queries and of the attention's output: heads x head_dim (hidden
        unless kv_channels says otherwise)."""
        return self.heads * self.head_dim

    @property
    def layers_per_stage(self) -> int:
        return self.num_layers // self.pp

    @property
    def model_parallel(self) -> int:
        """GPUs of one model replica: tp x pp x cp (Megatron's model-parallel size)."""
        return self.tp * self.pp * self.cp

    def replace(self, **changes: Any) -> "ModelShape":
        return dataclasses.replace(self, **changes)

    # -- presets ------------------------------------------------------------------------------

    PRESET_MODEL_KEYS = ("num_layers", "hidden", "heads", "ffn_hidden", "seq_len", "micro_batch",
                         "kv_groups", "kv_channels", "dtype", "swiglu", "swiglu_fusion", "flash_attention",
                         "recompute", "vocab", "attention_dropout", "hidden_dropout",
                         "num_experts", "moe_topk", "moe_ffn_hidden", "fp8", "moe_grouped_gemm")
    PRESET_PARALLEL_KEYS = ("tp", "pp", "sequence_parallel", "ep", "cp", "dp",
                            "distributed_optimizer", "vp", "tp_comm_overlap",
                            "overlap_grad_reduce", "overlap_param_gather", "grad_reduce_in_bf16",
                            "fp8_param_gather")
    PRESET_PARALLEL_KEYS += ("main_grad_bytes", "optimizer_offload_fraction", "overlap_optimizer_d2h_h2d")

    @classmethod
    def from_preset(cls, model: Mapping, parallel: Optional[Mapping] = None) -> "ModelShape":
        """Build a shape from a preset's ``model:`` and ``parallel:`` mappings.

        ``model.dtype`` is 'bf16', 'fp16' or 'fp32'; every other key is a field of this class.

        Raises:
            ValueError: an unknown key, a missing key or an invalid value, named in one line.
        """
        if not isinstance(model, Mapping):
            raise ValueError(f"model: expected a mapping of model fields, got {type(model).__name__}")
        parallel = {} if parallel is None else parallel
        if not isinstance(parallel, Mapping):
            raise ValueError(f"parallel: expected a mapping, got {type(parallel).__name__}")
        for section, data, allowed in (("model", model, cls.PRESET_MODEL_KEYS),
                                       ("parallel", parallel, cls.PRESET_PARALLEL_KEYS)):
            unknown = sorted(str(k) for k in data if k not in allowed)
            if unknown:
                raise ValueError(f"{section}: unknown key(s) {', '.join(unknown)}; allowed: "
                                 + ", ".join(allowed))
        required = ("num_layers", "hidden", "heads", "ffn_hidden", "seq_len", "micro_batch")
        missing = [k for k in required if k not in model]
        if missing:
            raise ValueError(f"model: missing key(s) {', '.join(missing)}")
        fields = {k: v for k, v in model.items() if k != "dtype"}
        if "dtype" in model:
            if model["dtype"] not in DTYPE_BYTES:
                raise ValueError(f"model.dtype={model['dtype']!r} is invalid: allowed: "
                                 + ", ".join(DTYPE_BYTES))
            fields["dtype_bytes"] = DTYPE_BYTES[model["dtype"]]
        fields.update(parallel)
        return cls(**fields)


@dataclass(frozen=True)
class SaveProfile:
    """How an implementation saves tensors for backward: the knobs that differ between the
    paper's accounting and what a given megatron-core layer spec really hands to autograd.

    Use :meth:`paper` for Korthikanti et al.'s figures and :meth:`megatron_local_cpu` for
    megatron-core's local (unfused torch) spec as it runs on CPU in the tests.
    """

    dropout_mask_bytes: Optional[int] = 1
    """Bytes per element of a saved dropout mask. 1: the bool mask of CUDA's fused dropout.
    None: the activation dtype; CPU dropout multiplies by a noise tensor of the input's dtype
    and saves that tensor instead of a bool mask."""

    softmax_bytes: Optional[int] = None
    """Bytes per element of the saved softmax output; None: the activation dtype (4 when the
    softmax runs in fp32 on 16-bit activations)."""

    small_fp32_stats: bool = False
    """Count the small fp32 statistics: LayerNorm mean and rstd (s*b each), flash attention's
    log-sum-exp (b*a*s). Usually below the offloader's min_tensor_bytes."""

    attention_mask: bool = False
    """Count the [1, 1, s, s] bool causal mask that unfused attention (masked_fill) and megatron's
    recompute checkpoints save. One tensor for all layers: see ``include_shared``."""

    expand_kv: bool = False
    """Unfused attention saves key and value repeated to all query heads under GQA
    (repeat_interleave before baddbmm/bmm); flash attention keeps them grouped."""

    count_aliased_views: bool = False
    """Count a saved view of an already-saved tensor again. With attention dropout 0 the bmm
    saves a reshaped view of the softmax output; an offloader that keys records by
    (storage, offset, shape, strides) writes it a second time."""

    strided_view_span: bool = True
    """Count a strided view saved for backward by the storage span it lies in, as our offloader
    writes it (it packs a view compactly only when the span is more than twice the view's
    elements). The unfused SwiGLU's gate half is such a view of the fc1 output: its span is
    almost the whole fc1 output, 2f wide instead of f. False: count the view's elements, as a
    pack hook sees them."""

    def __post_init__(self) -> None:
        for name in ("dropout_mask_bytes", "softmax_bytes"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"SaveProfile.{name}={value!r} is invalid: "
                                 "expected an integer >= 1 or None (activation dtype)")

    @classmethod
    def paper(cls) -> "SaveProfile":
        """Korthikanti et al. (and the SSDTrain paper): bool dropout masks, softmax output in
        the activation dtype, no small statistics, no attention mask."""
        return cls()

    @classmethod
    def megatron_local_cpu(cls) -> "SaveProfile":
        """megatron-core's ``get_gpt_layer_local_spec`` on CPU: dropout noise tensors in the
        activation dtype, LayerNorm statistics, the causal mask, expanded GQA key/value and
        every distinct view counted (as an identity-keyed offloader records them)."""
        return cls(dropout_mask_bytes=None, softmax_bytes=None, small_fp32_stats=True,
                   attention_mask=True, expand_kv=True, count_aliased_views=True)


PAPER = SaveProfile.paper()
SDPA_SPEC = SaveProfile(count_aliased_views=True)
"""megatron-core's layers with core attention on torch's SDPA (the gpu check's compute-bound
spec, tools/gpucheck/gpu_check_sdpa.py): what a CUDA run saves, each view a record of its own,
so SDPA's output and the projection's view of it both count (tests/test_gpu_saved_bytes.py
compares the terms with what the spec saves on CPU)."""
