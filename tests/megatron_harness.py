"""Train a tiny megatron-core GPTModel on CPU, in one process or in several (gloo), for tests.

``run_layout(spec, workdir)`` builds a GPTModel with the local layer spec for the parallel layout
in ``spec`` (TP, PP, virtual PP, recomputation), runs ``spec.iterations`` training iterations
through megatron's own ``get_forward_backward_func()`` with several micro-batches and an
optimizer step, and returns one :class:`RankResult` per rank with the losses of every
iteration and every gradient (CPU tensors keyed by parameter name), so tests can compare runs
bitwise.

A spec holds a list of *phases*: each phase rebuilds the model from the same seed and trains it
again, in the same processes. A phase may install the SSD offloader first (``offload``: the
OffloadConfig keyword arguments) and uninstall it after, so a test compares "plain",
"offloaded" and "plain again after uninstall()" runs without paying for process start-up three
times.

Multi-process layouts start ``world_size`` real processes the way torchrun does (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK in the environment), with the gloo backend; each
writes its result to a file in ``workdir`` and the parent reads them back. Single-process
layouts run in the calling process by default (faster; the process group and megatron's
parallel state are torn down afterwards).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from bitwise import bitwise_equal
from exactness import ExactnessOracle
from ranks import run_ranks
from settle_writes import settle_writes_before_backward


@dataclass
class Phase:
    """One training run inside a layout's processes."""

    name: str
    offload: Optional[Dict[str, Any]] = None
    """OffloadConfig keyword arguments; when set, ssdtrain_megatron.megatron.install() runs
    before the model is built and uninstall() after the last iteration. A "dirs" entry may use
    "{root}" for the run's offload root (a per-layout directory the parent creates)."""

    recompute_layers: Optional[List[int]] = None
    """Offload-phase only: layer numbers the recompute fallback runs under checkpoint."""

    iterations: Optional[int] = None
    """Training iterations of this phase (default: the spec's)."""

    load: Optional[str] = None
    """A checkpoint folder a ``save`` phase wrote: model, optimizer and RNG states and the
    iteration are restored after the model is built, and training resumes at that iteration
    (its batches are the ones an uninterrupted run trains there), as Megatron's --load does."""

    save: Optional[str] = None
    """A folder to write a checkpoint to after the last iteration (one file per rank)."""

    settle_writes: bool = True
    """Offload-phase only: every queued write finishes before a backward is announced (as
    ``run_steps(wait_writes=True)``). A write still queued when backward wants its tensor is
    taken back, so without this what a step writes and reads depends on how far the IO threads
    got, and a loaded 2-core machine can take back every write of a small stage. Take-back and
    forwarding from memory have their own tests (tests/test_held.py, tests/test_offloader.py)."""

    pause: Optional[str] = None
    """Offload-phase only: a folder shared with the parent. At the first loss of iteration 1
    (forward done, its writes waited for: activations on disk) each rank creates
    ``paused.<rank>`` there and waits until ``resume`` appears, so the parent can look at (and
    sweep around) a live job's files."""


@dataclass
class LayoutSpec:
    """A model, a parallel layout and a training schedule, all tiny."""

    tp: int = 1
    pp: int = 1
    vp: Optional[int] = None
    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 4
    ffn_hidden_size: Optional[int] = 128
    """None: megatron-core's default (4 x hidden_size)."""
    vocab_size: int = 64
    seq_length: int = 16
    micro_batch_size: int = 2
    num_microbatches: int = 4
    iterations: int = 3
    seed: int = 1234
    dropout: float = 0.1
    bias_dropout_fusion: Optional[bool] = False
    """None: megatron-core's default (TransformerConfig.bias_dropout_fusion)."""
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    recompute_modules: Optional[List[str]] = None
    optimizer: str = "adam"
    lr: float = 1e-3
    eval_iterations: int = 0
    """forward_only steps after training (grad left enabled, to show they are not recorded)."""
    device: str = "cpu"
    """"cpu" (gloo, megatron_cpu_compat) or "cuda" (nccl, one device per rank)."""
    layer_spec: str = "local"
    """"local" (get_gpt_layer_local_spec) or "transformer_engine" (needs CUDA and TE)."""
    sequence_parallel: bool = False
    add_bias_linear: bool = True
    dp: int = 1
    """Data-parallel ranks: each trains its own micro-batches; dense gradients are averaged
    over them before the optimizer step (expert gradients over the expert-data-parallel
    group), as megatron's DDP does."""
    cp: int = 1
    """Context-parallel ranks: each trains its slice of every sequence (megatron's
    get_batch_on_this_cp_rank); needs the Transformer Engine spec (CUDA)."""
    ep: int = 1
    """Expert-parallel ranks (megatron carves them out of the data-parallel ranks)."""
    num_moe_experts: Optional[int] = None
    """Mixture of experts in every layer (SequentialMLP experts on the local spec) when set."""
    moe_router_topk: int = 2
    moe_token_dispatcher_type: str = "allgather"
    moe_aux_loss_coeff: float = 1e-2
    moe_grouped_gemm: bool = False
    """Grouped-GEMM experts (CUDA only) instead of SequentialMLP."""
    swiglu: bool = False
    """SwiGLU MLP and experts (gated_linear_unit with SiLU) instead of GeLU."""
    swiglu_fusion: bool = False
    """With ``swiglu``: megatron-core's fused SwiGLU (bias_activation_fusion); experts then
    run the weighted variant that applies the router's probabilities inside."""
    kv_channels: Optional[int] = None
    """Width of one attention head (megatron's kv_channels); None: hidden / heads."""
    multi_latent_attention: bool = False
    """Multi-latent attention (MLATransformerConfig). The local spec's DotProductAttention
    takes no ``k_channels`` (megatron-core 0.16.1, 0.17.1): on the local spec the core
    attention is tests/mla_attention_stand_in.py's, every other MLA module megatron-core's."""
    phases: List[Phase] = field(default_factory=lambda: [Phase("plain")])
    timeout_s: float = 240.0

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "LayoutSpec":
        data = json.loads(text)
        data["phases"] = [Phase(**p) for p in data["phases"]]
        return cls(**data)


@dataclass
class PhaseResult:
    name: str
    losses: List[List[float]]
    """Per iteration, the loss of each micro-batch (last pipeline stage only; else empty)."""
    loss_tensors: List[List[torch.Tensor]]
    """Same as losses, as the exact float32 tensors (for bitwise comparison)."""
    grads: List[Dict[str, torch.Tensor]]
    """Per iteration, every parameter's gradient before the optimizer step."""
    params: Dict[str, torch.Tensor]
    """Parameters after the last optimizer step."""
    eval_losses: List[List[torch.Tensor]] = field(default_factory=list)
    """Per forward_only iteration, the loss of each micro-batch (last pipeline stage)."""
    offload: Dict[str, Any] = field(default_factory=dict)
    """Offload phases: per-step statistics ("steps", StepStats as dicts), "rank_dirs", files
    seen under the offload root during forward ("files_seen") and after each step
    ("files_after_step": (path, size, allocated bytes) of this rank's files), "files_after_close", and the integration's
    counters ("mispredictions", "steps_predicted", "fallback_layers_run")."""


@dataclass
class RankResult:
    rank: int
    tp_rank: int
    pp_rank: int
    phases: Dict[str, PhaseResult]


# ----------------------------------------------------------------------------------------------
# Parent side


_MOE: Dict[str, Any] = dict(dp=2, ep=2, num_moe_experts=4, moe_router_topk=2, num_layers=2,
                            num_microbatches=2)

# The parallel layouts the megatron tests train (test_megatron_cpu, test_megatron_integration).
LAYOUTS = {
    "tp1_pp1": LayoutSpec(),
    "tp2": LayoutSpec(tp=2),
    "pp2_1f1b": LayoutSpec(pp=2),
    "pp2_interleaved_vp2": LayoutSpec(pp=2, vp=2),
    "recompute_full_uniform": LayoutSpec(recompute_granularity="full",
                                         recompute_method="uniform", recompute_num_layers=2),
    "recompute_full_block": LayoutSpec(recompute_granularity="full",
                                       recompute_method="block", recompute_num_layers=2),
    "recompute_selective": LayoutSpec(recompute_granularity="selective"),
    # megatron-core 0.16.1 recurses forever in backward when "mlp" recompute meets linear
    # biases (the MLP returns the fc2 bias Parameter through CheckpointFunction): no biases.
    "recompute_selective_mlp": LayoutSpec(recompute_granularity="selective",
                                          recompute_modules=["core_attn", "mlp"],
                                          add_bias_linear=False),
    # Layernorm outputs freed by megatron and refilled in backward (CheckpointWithoutOutput):
    # install() keeps them with autograd (megatron/discarded.py). Broken variant: drop that
    # patch from install.py _patch: 24 writes a step read freed memory and fall back
    # ("Bad address"), and the per-layout test's fallbacks == 0 fails.
    "recompute_selective_layernorm": LayoutSpec(recompute_granularity="selective",
                                                recompute_modules=["core_attn", "layernorm"]),
    "pp2_recompute_full": LayoutSpec(pp=2, recompute_granularity="full",
                                     recompute_method="uniform", recompute_num_layers=1),
    # Mixture of experts (4 SequentialMLP experts, top-2, aux loss), expert parallel over the
    # two data-parallel ranks: two layers and two micro-batches keep each one ~15 s a run.
    "moe_ep2_allgather": LayoutSpec(**_MOE),
    "moe_ep2_alltoall_recompute_selective": LayoutSpec(
        **_MOE, moe_token_dispatcher_type="alltoall", recompute_granularity="selective"),
    "moe_ep2_recompute_full": LayoutSpec(**_MOE, recompute_granularity="full",
                                         recompute_method="uniform", recompute_num_layers=1),
    # Four processes (EP=2 x PP=2), two layers a stage (with one, the last stage's only layer
    # is the last layer, whose backward follows its forward at once: nothing to read back).
    # In the default suite: measured on the shared 2-core machine (load average ~7), its
    # integration tests take 30 s and its test_megatron_cpu run 39 s.
    "moe_ep2_pp2": LayoutSpec(**{**_MOE, "num_layers": 4}, pp=2),
    # Multi-latent attention (DeepSeek's: low-rank q and kv with layernorms, yarn rotary part)
    # on the local spec; its core attention is tests/mla_attention_stand_in.py's. Broken
    # variant: flip the low bit of the last element of every restored float32 [*, *, 12]
    # tensor (MLA's 12-wide queries) in cache/hooks.py _unpack: the integration test's
    # bitwise comparison fails ("grad of ...linear_kv_down_proj.weight differs").
    "mla": LayoutSpec(multi_latent_attention=True),
    # MLA split over two tensor-parallel ranks (heads and up-projections split, the low-rank
    # down-projections gathered): ~10 s a run on the shared 2-core machine.
    "mla_tp2": LayoutSpec(tp=2, multi_latent_attention=True),
    # MLA's own selective recompute: megatron frees the up-projections' outputs (queries,
    # keys, values) after the core attention saved them, and refills them in backward
    # (CheckpointWithoutOutput); install() keeps those with autograd (megatron/discarded.py).
    # Broken variant: drop that patch from install.py _patch: every write of them reads freed
    # memory ("Bad address") and falls back, and the per-layout test's fallbacks == 0 fails.
    "mla_recompute_up_proj": LayoutSpec(multi_latent_attention=True,
                                        recompute_granularity="selective",
                                        recompute_modules=["mla_up_proj"]),
}

# megatron-core's standard full recomputation, as issue 37 measured it (tests/test_megatron_waste.py
# trains it with STANDARD_OFFLOAD): GPTModel, local spec, fp32, 4 layers, hidden 128 (the FFN at
# megatron-core's default 4 x hidden), 4 heads, PP=2, recompute_granularity "full", method
# "uniform", one layer per checkpoint, dropout 0.1 in attention and in every bias-dropout-add
# (bias_dropout_fusion at megatron-core's default), 4 micro-batches of 2 x 64 tokens, SGD,
# 3 iterations; a 128-token vocabulary (the issue gave none; with it its figures reproduce:
# rank 0 writes 1.6-1.85 MB a step and reads 0.79 MB, rank 1 reads 1.06 MB). Its twin has no
# dropout. ~35 s a layout on the shared 2-core machine at load 9 (pp2_recompute_full: ~43 s).
_STANDARD_FULL_RECOMPUTE = LayoutSpec(
    pp=2, num_layers=4, hidden_size=128, num_attention_heads=4, ffn_hidden_size=None,
    vocab_size=128, seq_length=64, micro_batch_size=2, num_microbatches=4, iterations=3,
    dropout=0.1, bias_dropout_fusion=None, recompute_granularity="full",
    recompute_method="uniform", recompute_num_layers=1, optimizer="sgd")
STANDARD_LAYOUTS = {
    "standard_full_recompute": _STANDARD_FULL_RECOMPUTE,
    "standard_full_recompute_no_dropout": dataclasses.replace(_STANDARD_FULL_RECOMPUTE, dropout=0.0),
}
STANDARD_OFFLOAD: Dict[str, Any] = dict(engine="posix", policy="offload", min_tensor_bytes=0,
                                        keep_last_layers=0)
"""The OffloadConfig of issue 37's run (one root, the harness's "{root}")."""

SLOW_LAYOUTS: set = {"moe_ep2_pp2"}
"""Layouts too slow for the default suite (-m slow): moe_ep2_pp2 (~30 s; MoE is trained by
the other moe_ep2_* layouts, PP=2 by the pp2_* ones)."""


def layout_params() -> list:
    """LAYOUTS' names for pytest.mark.parametrize, the SLOW_LAYOUTS marked slow."""
    import pytest

    return [pytest.param(name, marks=pytest.mark.slow) if name in SLOW_LAYOUTS else name
            for name in LAYOUTS]


def run_layout(spec: LayoutSpec, workdir: str, in_process: Optional[bool] = None
               ) -> List[RankResult]:
    """Run every phase of ``spec``; return the results of all ranks, ordered by rank."""
    os.makedirs(workdir, exist_ok=True)
    if in_process is None:
        in_process = spec.world_size == 1
    if in_process:
        if spec.world_size != 1:
            raise ValueError("in_process runs need world_size 1")
        return [_run_in_this_process(spec, workdir)]
    return _run_processes(spec, workdir)


def _run_in_this_process(spec: LayoutSpec, workdir: str) -> RankResult:
    import torch.distributed as dist

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    backend = "nccl" if spec.device == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _train_all_phases(spec, workdir)
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)


def _run_processes(spec: LayoutSpec, workdir: str) -> List[RankResult]:
    return run_ranks("megatron_harness", spec.to_json(), spec.world_size, spec.timeout_s, workdir)


# ----------------------------------------------------------------------------------------------
# Worker side


def _worker_main() -> None:
    import torch.distributed as dist

    spec_path, workdir = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = LayoutSpec.from_json(f.read())
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    if spec.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if spec.device == "cuda" else "gloo", rank=rank,
                            world_size=int(os.environ["WORLD_SIZE"]))
    try:
        result = _train_all_phases(spec, workdir)
        tmp = os.path.join(workdir, f"result{rank}.pt.tmp")
        torch.save(result, tmp)
        os.replace(tmp, os.path.join(workdir, f"result{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _train_all_phases(spec: LayoutSpec, workdir: str) -> RankResult:
    import megatron_cpu_compat
    from megatron.core import parallel_state

    if spec.device == "cpu":
        megatron_cpu_compat.enable()
    try:
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=spec.tp,
            pipeline_model_parallel_size=spec.pp,
            virtual_pipeline_model_parallel_size=spec.vp,
            expert_model_parallel_size=spec.ep,
            context_parallel_size=spec.cp,
        )
        try:
            result = RankResult(
                rank=torch.distributed.get_rank(),
                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
                phases={},
            )
            for phase in spec.phases:
                result.phases[phase.name] = _train_phase(spec, phase, workdir)
            return result
        finally:
            parallel_state.destroy_model_parallel()
    finally:
        if spec.device == "cpu":
            megatron_cpu_compat.disable()


def make_config(spec: LayoutSpec):
    """The TransformerConfig of ``spec`` (fp32, no fusions, CPU initialisation)."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kwargs: Dict[str, Any] = {}
    config_cls = TransformerConfig
    if spec.multi_latent_attention:
        # Low-rank queries and keys/values with their layernorms, decoupled rotary part with
        # yarn scaling: DeepSeek's shape, tiny. Query/key heads 12 wide, value heads 6, neither
        # hidden / heads (8), as in DeepSeek. The local spec's torch norms take LayerNorm;
        # yarn's fused apply (a Triton kernel) stays off, as every fusion here.
        config_cls = MLATransformerConfig
        kwargs.update(q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
                      v_head_dim=6, normalization="LayerNorm", rope_type="yarn",
                      qk_layernorm=True)
    if spec.swiglu:
        kwargs.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                      bias_activation_fusion=spec.swiglu_fusion)
    if spec.kv_channels is not None:
        kwargs["kv_channels"] = spec.kv_channels
    if spec.recompute_granularity is not None:
        kwargs["recompute_granularity"] = spec.recompute_granularity
    if spec.recompute_method is not None:
        kwargs["recompute_method"] = spec.recompute_method
    if spec.recompute_num_layers is not None:
        kwargs["recompute_num_layers"] = spec.recompute_num_layers
    if spec.recompute_modules is not None:
        kwargs["recompute_modules"] = list(spec.recompute_modules)
    if spec.bias_dropout_fusion is not None:
        kwargs["bias_dropout_fusion"] = spec.bias_dropout_fusion
    return config_cls(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        ffn_hidden_size=spec.ffn_hidden_size,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        virtual_pipeline_model_parallel_size=spec.vp,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        use_cpu_initialization=True,
        sequence_parallel=spec.sequence_parallel,
        context_parallel_size=spec.cp,
        add_bias_linear=spec.add_bias_linear,
        hidden_dropout=spec.dropout,
        attention_dropout=spec.dropout,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        **kwargs,
        **_moe_kwargs(spec),
    )


def _moe_kwargs(spec: LayoutSpec) -> Dict[str, Any]:
    """TransformerConfig fields of a mixture-of-experts layout (none for a dense one)."""
    if spec.num_moe_experts is None:
        return {}
    return dict(num_moe_experts=spec.num_moe_experts, moe_router_topk=spec.moe_router_topk,
                expert_model_parallel_size=spec.ep,
                moe_token_dispatcher_type=spec.moe_token_dispatcher_type,
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=spec.moe_aux_loss_coeff, moe_grouped_gemm=spec.moe_grouped_gemm)


def build_model(spec: LayoutSpec, config) -> List[torch.nn.Module]:
    """One GPTModel per virtual pipeline stage on this rank (a list of one without VP)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs

    if spec.layer_spec == "transformer_engine":
        layer_spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.num_moe_experts, moe_grouped_gemm=spec.moe_grouped_gemm,
            multi_latent_attention=spec.multi_latent_attention,
            qk_layernorm=spec.multi_latent_attention)
    else:
        layer_spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=spec.num_moe_experts, moe_grouped_gemm=spec.moe_grouped_gemm,
            multi_latent_attention=spec.multi_latent_attention,
            qk_layernorm=spec.multi_latent_attention)
        if spec.multi_latent_attention:  # the local DotProductAttention takes no k_channels
            from mla_attention_stand_in import MlaCoreAttentionStandIn

            layer_spec.submodules.self_attention.submodules.core_attention = \
                MlaCoreAttentionStandIn
    chunks = []
    for vp_stage in range(spec.vp or 1):
        vp = vp_stage if spec.vp is not None else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            vp_stage=vp,
        )
        if spec.device == "cuda":
            model.cuda(torch.cuda.current_device())
        model.train()
        chunks.append(model)
    return chunks


def make_batches(spec: LayoutSpec, iteration: int) -> List[Dict[str, torch.Tensor]]:
    """The micro-batches of one iteration: random tokens, next-token labels, a loss mask."""
    from megatron.core import parallel_state

    dp_rank = parallel_state.get_data_parallel_rank() if spec.dp > 1 else 0
    gen = torch.Generator().manual_seed(spec.seed * 1000 + iteration + 7919 * dp_rank)
    batches = []
    s, b = spec.seq_length, spec.micro_batch_size
    for _ in range(spec.num_microbatches):
        tokens = torch.randint(0, spec.vocab_size, (b, s + 1), generator=gen)
        mask = (torch.rand(b, s, generator=gen) > 0.1).float()
        batches.append({
            "tokens": tokens[:, :-1].contiguous(),
            "labels": tokens[:, 1:].contiguous(),
            "loss_mask": mask,
            "position_ids": torch.arange(s).unsqueeze(0).expand(b, s).contiguous(),
        })
    return batches


def _causal_mask(s: int) -> torch.Tensor:
    # megatron convention: True marks a position that must NOT be attended to.
    return torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)


def _param_name_map(chunks: List[torch.nn.Module]) -> List[tuple]:
    named = []
    for i, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            named.append((f"chunk{i}.{name}", p))
    return named


class _OffloadPhase:
    """Install/uninstall of ssdtrain_megatron around one phase, and what it observed."""

    def __init__(self, phase: Phase, workdir: str, timeout_s: float):
        from ssdtrain_megatron import OffloadConfig
        from ssdtrain_megatron.megatron import install

        kwargs = dict(phase.offload)
        self.root = os.path.join(workdir, "offload_root")
        kwargs["dirs"] = [d.replace("{root}", self.root) for d in kwargs.get("dirs", ["{root}"])]
        if kwargs.get("stats_path"):  # "{workdir}": beside the offload root, not under it
            kwargs["stats_path"] = kwargs["stats_path"].replace("{workdir}", workdir)
        for d in kwargs["dirs"]:  # the drives, mounted: the part of each template above {job}
            root = d.split("{job}")[0]
            if "{" not in root:  # a per-node root ({hostname}, {local_rank}): the test mounts it
                os.makedirs(root, exist_ok=True)
        if phase.recompute_layers is not None:
            kwargs.update(recompute_fallback=True, recompute_layers=list(phase.recompute_layers))
        # Every tensor the offloader packs is compared with what it unpacks (tests/exactness.py);
        # phase_differences reports a mismatch like a differing gradient.
        self.oracle = ExactnessOracle().__enter__()
        try:
            self.offloader = install(OffloadConfig(**kwargs))
        except BaseException:
            self.oracle.__exit__(None, None, None)
            raise
        if phase.settle_writes:
            settle_writes_before_backward(self.offloader)
        self.rank_dirs = [os.path.realpath(d) for d in self.offloader.rank_dirs]
        self.steps: List[Dict[str, Any]] = []
        self.files_seen: set = set()
        self.files_after_step: List[List[str]] = []
        self.disk_bytes_after_step: List[int] = []
        self.last_step_after_eval: Optional[int] = None
        self.pause, self.pause_timeout_s, self.paused = phase.pause, timeout_s, False

    def pause_point(self, iteration: int) -> None:
        """Phase.pause: hold this rank at its first loss of iteration 1 until ``resume``."""
        if self.pause is None or self.paused or iteration != 1:
            return
        self.paused = True
        self.offloader.wait_writes()
        open(os.path.join(self.pause, f"paused.{torch.distributed.get_rank()}"), "w").close()
        deadline = time.monotonic() + self.pause_timeout_s
        while not os.path.exists(os.path.join(self.pause, "resume")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {self.pause}/resume after {self.pause_timeout_s} s")
            time.sleep(0.05)

    def observe_files(self) -> None:
        for dirpath, _, files in os.walk(self.root):
            for f in files:
                self.files_seen.add(os.path.realpath(os.path.join(dirpath, f)))

    def end_of_iteration(self) -> None:
        stats = self.offloader.last_step_stats
        row = dataclasses.asdict(stats) if stats is not None else None
        self.steps.append(row)
        files, allocated = [], 0
        for d in self.rank_dirs:  # other ranks may still be inside their step
            for dirpath, _, names in os.walk(d):
                for n in names:
                    path = os.path.realpath(os.path.join(dirpath, n))
                    st = os.stat(path)
                    files.append((path, st.st_size, st.st_blocks * 512))
                    allocated += st.st_blocks * 512
        self.files_after_step.append(sorted(files))
        self.disk_bytes_after_step.append(allocated)

    def after_eval(self) -> None:
        stats = self.offloader.last_step_stats
        self.last_step_after_eval = stats.step if stats is not None else None

    def finish(self) -> Dict[str, Any]:
        from ssdtrain_megatron.megatron import installed, uninstall

        inst = installed()
        hooks = {
            "mispredictions": inst.pipeline.mispredictions,
            "steps_predicted": inst.pipeline.steps_predicted,
            "fallback_layers_run": inst.scopes.fallback_layers_run,
        }
        uninstall()
        self.offloader.close()
        self.oracle.__exit__(None, None, None)
        left = []
        for d in self.rank_dirs:  # other ranks may not have closed yet
            for dirpath, _, names in os.walk(d):
                left.extend(os.path.join(dirpath, n) for n in names)
        return {
            "root": os.path.realpath(self.root),
            "rank_dirs": self.rank_dirs,
            "steps": self.steps,
            "files_seen": sorted(self.files_seen),
            "files_after_step": self.files_after_step,
            "disk_bytes_after_step": self.disk_bytes_after_step,
            "files_after_close": sorted(left),
            "exactness": self.oracle.report(),
            "last_step_after_eval": self.last_step_after_eval,
            **hooks,
        }


def _make_optimizer(spec: LayoutSpec, params: List[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if spec.optimizer == "adam":
        return torch.optim.Adam(params, lr=spec.lr)
    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.lr)
    raise ValueError(f"optimizer {spec.optimizer!r}: expected 'adam' or 'sgd'")


def _run_step(spec: LayoutSpec, chunks, mask: Optional[torch.Tensor], device: torch.device,
              offload: Optional["_OffloadPhase"], iteration: int, forward_only: bool) -> List[torch.Tensor]:
    """One step through megatron's own forward_backward_func (looked up now, as a training
    script does); the loss of each micro-batch, in order."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = [{k: v.to(device) for k, v in b.items()} for b in make_batches(spec, iteration)]
    if spec.cp > 1:  # this rank's slices of each sequence; TE's attention is causal by type
        from megatron.core.utils import get_batch_on_this_cp_rank

        batches = [get_batch_on_this_cp_rank(b) for b in batches]
        mask = None
    iterators = [iter(batches) for _ in chunks]
    step_losses: List[torch.Tensor] = []

    def loss_func(loss_mask, output_tensor):
        per_token = output_tensor.float()
        loss = torch.sum(per_token.view(-1) * loss_mask.view(-1)) / loss_mask.sum()
        step_losses.append(loss.detach().cpu().clone())
        if offload is not None:
            offload.pause_point(iteration)
        return loss, {"lm loss": loss.detach()}

    def forward_step_func(data_iterator, model):
        batch = next(data_iterator)
        if offload is not None:
            offload.observe_files()
        output = model(batch["tokens"], batch["position_ids"], mask, labels=batch["labels"])
        return output, lambda out: loss_func(batch["loss_mask"], out)

    forward_backward = get_forward_backward_func()
    forward_backward(
        forward_step_func=forward_step_func,
        data_iterator=iterators if spec.vp is not None else iterators[0],
        model=chunks if spec.vp is not None else chunks[0],
        num_microbatches=spec.num_microbatches,
        seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size,
        forward_only=forward_only,
    )
    return step_losses


def _average_data_parallel_grads(spec: LayoutSpec, params: List[torch.nn.Parameter]) -> None:
    """What megatron's DDP does to gradients before the step: dense ones averaged over the
    data-parallel group, expert ones (``allreduce`` False) over the expert-data-parallel one."""
    from megatron.core import parallel_state

    if spec.dp * spec.cp == 1:
        return
    groups = {True: parallel_state.get_data_parallel_group(with_context_parallel=True),
              False: parallel_state.get_expert_data_parallel_group()}
    for p in params:
        if p.grad is None:
            continue
        group = groups[getattr(p, "allreduce", True)]
        size = torch.distributed.get_world_size(group)
        if size > 1:
            torch.distributed.all_reduce(p.grad, group=group)
            p.grad.div_(size)


def _train_phase(spec: LayoutSpec, phase: Phase, workdir: str) -> PhaseResult:
    # install() first: the training loop looks get_forward_backward_func up afterwards, as a
    # Megatron-LM training script that imports it at module level would see the patched one.
    offload = _OffloadPhase(phase, workdir, spec.timeout_s) if phase.offload is not None else None
    try:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        torch.manual_seed(spec.seed)
        model_parallel_cuda_manual_seed(spec.seed, force_reset_rng=True)
        if spec.num_moe_experts is not None:
            # megatron-core's process-wide aux-loss tracker is sized by the first MoE model's
            # layer count: start each phase as a fresh training process would.
            from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

            get_moe_layer_wise_logging_tracker().clear()
        config = make_config(spec)
        chunks = build_model(spec, config)
        named = _param_name_map(chunks)
        params = [p for _, p in named]
        if offload is not None:
            offload.offloader.register_parameters(params)
        opt = _make_optimizer(spec, params)
        first = _load_checkpoint(phase.load, chunks, opt) if phase.load else 0
        iterations = spec.iterations if phase.iterations is None else phase.iterations
        device = torch.device(spec.device, torch.cuda.current_device()) \
            if spec.device == "cuda" else torch.device("cpu")
        mask = _causal_mask(spec.seq_length).to(device)
        losses: List[List[float]] = []
        loss_tensors: List[List[torch.Tensor]] = []
        grads: List[Dict[str, torch.Tensor]] = []
        eval_losses: List[List[torch.Tensor]] = []
        for it in range(first, first + iterations):
            opt.zero_grad(set_to_none=True)
            step_losses = _run_step(spec, chunks, mask, device, offload, it, forward_only=False)
            if offload is not None:
                offload.end_of_iteration()
            _average_data_parallel_grads(spec, params)
            grads.append({n: (p.grad.detach().cpu().clone() if p.grad is not None else None)
                          for n, p in named})
            opt.step()
            losses.append([float(x) for x in step_losses])
            loss_tensors.append(step_losses)
        for it in range(spec.eval_iterations):
            # Grad stays enabled on purpose: forward_only steps must not be recorded even then.
            eval_losses.append(_run_step(spec, chunks, mask, device, offload, first + iterations + it,
                                         forward_only=True))
        if offload is not None:
            offload.after_eval()
        if phase.save:
            _save_checkpoint(phase.save, chunks, opt, first + iterations)

        return PhaseResult(
            name=phase.name,
            losses=losses,
            loss_tensors=loss_tensors,
            grads=grads,
            params={n: p.detach().cpu().clone() for n, p in named},
            eval_losses=eval_losses,
            offload=offload.finish() if offload is not None else {},
        )
    except BaseException:
        if offload is not None:
            from ssdtrain_megatron.megatron import uninstall

            uninstall()
            offload.offloader.close()
            offload.oracle.__exit__(None, None, None)
        raise


def _checkpoint_file(folder: str) -> str:
    return os.path.join(folder, f"rank{torch.distributed.get_rank()}.pt")


def _save_checkpoint(folder: str, chunks: List[torch.nn.Module], opt, iteration: int) -> None:
    """What Megatron's --save keeps that the next steps depend on: weights, optimizer state,
    the RNG states (torch's and megatron's model-parallel tracker) and the iteration."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    os.makedirs(folder, exist_ok=True)
    state = {"iteration": iteration, "model": [c.state_dict() for c in chunks],
             "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state(),
             "tracker_rng": get_cuda_rng_tracker().get_states()}
    tmp = _checkpoint_file(folder) + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, _checkpoint_file(folder))


def _load_checkpoint(folder: str, chunks: List[torch.nn.Module], opt) -> int:
    """Restore what _save_checkpoint kept; returns the iteration to resume at."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = torch.load(_checkpoint_file(folder), weights_only=False)
    for chunk, weights in zip(chunks, state["model"]):
        chunk.load_state_dict(weights)
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    get_cuda_rng_tracker().set_states(state["tracker_rng"])
    return int(state["iteration"])


# ----------------------------------------------------------------------------------------------
# Comparisons


def phase_differences(a: PhaseResult, b: PhaseResult) -> List[str]:
    """Every way two phase results differ bitwise (losses, gradients, final parameters), and
    every tensor an offload phase restored with other bytes than it packed (the exactness
    oracle: gradients and losses can hide a small error)."""
    diffs: List[str] = [f"{r.name}: {m}" for r in (a, b)
                        for m in r.offload.get("exactness", {}).get("mismatches", [])[:5]]
    for r in (a, b):
        ex, steps = r.offload.get("exactness"), r.offload.get("steps", [])
        if ex is not None and any(st and st.get("bytes_read") for st in steps) and not ex["compared_offloaded"]:
            diffs.append(f"{r.name}: bytes were read back but the exactness oracle compared none: {ex}")
    if len(a.loss_tensors) != len(b.loss_tensors):
        return [f"{a.name} ran {len(a.loss_tensors)} iterations, {b.name} {len(b.loss_tensors)}"]
    for it, (la, lb) in enumerate(zip(a.loss_tensors, b.loss_tensors)):
        if len(la) != len(lb) or not all(bitwise_equal(x, y) for x, y in zip(la, lb)):
            diffs.append(f"iteration {it}: losses {a.losses[it]} != {b.losses[it]}")
    if len(a.grads) != len(b.grads):
        diffs.append(f"{a.name} has gradients of {len(a.grads)} iterations, {b.name} of {len(b.grads)}")
    for it, (ga, gb) in enumerate(zip(a.grads, b.grads)):
        if ga.keys() != gb.keys():
            diffs.append(f"iteration {it}: parameter names differ")
            continue
        for name in ga:
            x, y = ga[name], gb[name]
            if (x is None) != (y is None) or (x is not None and not bitwise_equal(x, y)):
                delta = "one is None" if x is None or y is None else \
                    f"max |diff| {float((x - y).abs().max()):.3g}"
                diffs.append(f"iteration {it}: grad of {name} differs ({delta})")
    if a.params.keys() != b.params.keys():
        diffs.append("final parameter names differ")
    for name in a.params.keys() & b.params.keys():
        if not bitwise_equal(a.params[name], b.params[name]):
            diffs.append(f"final parameter {name} differs")
    if len(a.eval_losses) != len(b.eval_losses) or not all(
            len(x) == len(y) and all(bitwise_equal(u, v) for u, v in zip(x, y))
            for x, y in zip(a.eval_losses, b.eval_losses)):
        diffs.append("forward_only losses differ")
    return diffs


def all_finite(result: PhaseResult) -> bool:
    return all(torch.isfinite(x).all() for step in result.loss_tensors for x in step) and all(
        g is None or bool(torch.isfinite(g).all()) for step in result.grads for g in step.values())


if __name__ == "__main__":
    _worker_main()
