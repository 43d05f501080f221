"""A minimal pretraining loop built from megatron-core parts, for the demo and the benchmarks.

One process (TP=1, PP=1), megatron-core's ``GPTModel`` with the local layer spec, torch Adam,
mock data, and megatron's own ``get_forward_backward_func()`` looked up at every step, so an
``install()``-ed offloader sees the step exactly as in a Megatron-LM run. On a machine without
CUDA it runs on the CPU through ``ssdtrain_megatron.tools.megatron_cpu``.
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

log = logging.getLogger(__name__)

@dataclass
class GPTSpec:
    """Shape and schedule of the small GPT."""

    layers: int = 8
    hidden: int = 256
    heads: int = 4
    seq: int = 256
    vocab: int = 1024
    micro_batch: int = 4
    num_microbatches: int = 4
    recompute: Optional[str] = None
    """None, 'full' (megatron's full/uniform recompute, 1 layer per checkpoint) or 'selective'."""
    swiglu: bool = False
    """SwiGLU MLP (megatron-core's gated_linear_unit with SiLU) instead of GELU."""
    swiglu_fusion: bool = False
    """With ``swiglu``: megatron-core's fused bias-SwiGLU (``bias_activation_fusion``, the
    default of Megatron-LM's ``--bias-swiglu-fusion``); saves the fc1 output once."""
    seed: int = 1234
    lr: float = 1e-3

    @property
    def tokens_per_step(self) -> int:
        return self.seq * self.micro_batch * self.num_microbatches


class MegatronRuntime:
    """Process group, parallel state and (without CUDA) the CPU runtime, for one process.

    A context manager; nothing is left initialised after it exits (unless it found a process
    group already initialised, which it then leaves alone)."""

    def __init__(self) -> None:
        self._owns_group = False
        self._cpu = False
        self._tmp: Optional[str] = None

    def __enter__(self) -> "MegatronRuntime":
        import torch.distributed as dist
        from megatron.core import parallel_state

        self._cpu = not torch.cuda.is_available()
        if self._cpu:
            from . import megatron_cpu as cpu

            cpu.enable()
        if not dist.is_initialized():
            fd, self._tmp = tempfile.mkstemp(prefix="ssdtrain-pg-")
            os.close(fd)
            dist.init_process_group("gloo" if self._cpu else "nccl", init_method=f"file://{self._tmp}",
                                    rank=0, world_size=1)
            self._owns_group = True
        parallel_state.initialize_model_parallel(1, 1)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Every part undone, each tried even when one before it raised (after a sticky CUDA
        error, NCCL's teardown raises too). With an exception already on its way out, a part's
        error is logged and that exception goes on unchanged; else the first part's error is
        raised once all were tried."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        def unlink() -> None:
            if self._tmp and os.path.exists(self._tmp):
                os.unlink(self._tmp)

        def cpu_off() -> None:
            from . import megatron_cpu as cpu

            cpu.disable()

        parts = [parallel_state.destroy_model_parallel] + ([dist.destroy_process_group, unlink] if self._owns_group
                                                           else []) + ([cpu_off] if self._cpu else [])
        first: Optional[BaseException] = None
        for part in parts:
            try:
                part()
            except Exception as err:  # noqa: BLE001 - raised below, or logged under the exception in flight
                if exc is not None:
                    log.warning("MegatronRuntime: %s failed while %s was raised: %s", getattr(part, "__name__", part),
                                exc_type.__name__, err)
                first = first or err
        if first is not None and exc is None:
            raise first

    @property
    def device(self) -> torch.device:
        return torch.device("cpu") if self._cpu else torch.device("cuda", torch.cuda.current_device())


class MiniGPT:
    """A megatron-core GPT and its optimizer; ``step()`` trains one step (all micro-batches)."""

    def __init__(self, spec: GPTSpec, device: torch.device) -> None:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.spec = spec
        self.device = device
        torch.manual_seed(spec.seed)
        model_parallel_cuda_manual_seed(spec.seed, force_reset_rng=True)
        options: Dict[str, object] = {}  # recompute and MLP settings
        if spec.recompute == "full":
            options = {"recompute_granularity": "full", "recompute_method": "uniform",
                       "recompute_num_layers": 1}
        elif spec.recompute == "selective":
            options = {"recompute_granularity": "selective"}
        elif spec.recompute is not None:
            raise ValueError(f"GPTSpec.recompute={spec.recompute!r}: expected None, 'full' or 'selective'")
        if spec.swiglu:
            options.update(gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                           bias_activation_fusion=spec.swiglu_fusion)
        config = TransformerConfig(
            num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
            pipeline_dtype=torch.float32, params_dtype=torch.float32,
            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
            bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False, **options)
        self.model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                              vocab_size=spec.vocab, max_sequence_length=spec.seq,
                              share_embeddings_and_output_weights=False, position_embedding_type="rope")
        self.model.to(device)
        self.model.train()
        self.params = [p for p in self.model.parameters()]
        self.optimizer = torch.optim.Adam(self.params, lr=spec.lr)
        s = spec.seq
        self._mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=device).triu(1)
        self._positions = torch.arange(s, device=device).unsqueeze(0).expand(spec.micro_batch, s).contiguous()
        self.iteration = 0

    def batches(self, iteration: int) -> List[Dict[str, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.spec.seed * 1000 + iteration)
        out = []
        for _ in range(self.spec.num_microbatches):
            t = torch.randint(0, self.spec.vocab, (self.spec.micro_batch, self.spec.seq + 1), generator=g)
            out.append({"tokens": t[:, :-1].contiguous().to(self.device),
                        "labels": t[:, 1:].contiguous().to(self.device)})
        return out

    def step(self) -> float:
        """One training step; returns the mean loss over the micro-batches."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        losses: List[torch.Tensor] = []

        def loss_func(output):
            loss = output.float().mean()
            losses.append(loss.detach())
            return loss, {"lm loss": loss.detach()}

        def forward_step(data_iterator, model):
            b = next(data_iterator)
            return model(b["tokens"], self._positions, self._mask, labels=b["labels"]), loss_func

        self.optimizer.zero_grad(set_to_none=True)
        get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(self.batches(self.iteration)),
            model=self.model, num_microbatches=self.spec.num_microbatches, seq_length=self.spec.seq,
            micro_batch_size=self.spec.micro_batch, forward_only=False)
        self.optimizer.step()
        self.iteration += 1
        self.last_losses = [float(x) for x in losses]  # per micro-batch (the bench compares them)
        return float(torch.stack(losses).mean())


def timed(fn) -> tuple:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def installed_step(model: MiniGPT, offloader) -> Tuple[float, float]:
    """One training step of ``model`` with ``offloader`` installed into megatron-core for just
    that step: (mean loss, seconds). Several offloaders can take turns this way, step by step,
    each with its own model; ``uninstall(close=False)`` leaves each open for its next turn."""
    from ..megatron.install import install, uninstall

    install(offloader.config, offloader=offloader)
    try:
        return timed(model.step)
    finally:
        uninstall(close=False)
