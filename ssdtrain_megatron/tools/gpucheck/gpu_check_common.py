"""What the steps of `make gpu-check` share (gpu_check_steps.py, gpu_check_measure.py,
gpu_check_cuda.py): the model, the bit comparisons, the step deadline, and :class:`CudaBox`,
every call a step makes to the GPU itself, in one place.

Why a box: the steps run only on a GPU box, where a mistake in the check (a wrapper with the
wrong signature, a stream used in the wrong order) costs the one run there is. With the box
replaced by a stand-in (tests/test_gpu_check_steps.py: the recording streams of
tests/recording_streams.py, host callables for the sleeps, counters for memory), every step's
own code runs here on the CPU, through the same offloader, engines and copy layer.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import warnings
from typing import Any, Callable, ContextManager, Iterator, List, Optional, Tuple

import torch

from ssdtrain_megatron import OffloadConfig
from ssdtrain_megatron.tools.minigpt import GPTSpec, MiniGPT

GiB = 1 << 30
MiB = 1 << 20


def deadline_left() -> float:
    """Seconds until the step's deadline (GPU_CHECK_DEADLINE, set by the parent)."""
    return float(os.environ.get("GPU_CHECK_DEADLINE", time.time() + 1e9)) - time.time()


def activation_bytes(spec: GPTSpec, micro_batch: Optional[int] = None) -> int:
    """bf16 activations of one micro-batch of ``spec``: L b (34 s h + 5 a s^2) bytes
    (Korthikanti et al.); what a pool that holds one micro-batch's offload must carry."""
    b = spec.micro_batch if micro_batch is None else micro_batch
    return spec.layers * b * (34 * spec.seq * spec.hidden + 5 * spec.heads * spec.seq * spec.seq)


class CudaBox:
    """Every GPU call of the steps: streams for the offloader and for the measure step's own
    copies and timing events, the compute-stream delay, a side stream, the sync debug mode,
    memory statistics, device synchronisation. The CPU test subclasses it with stand-ins
    (module docstring)."""

    oom: type = torch.cuda.OutOfMemoryError

    def streams(self) -> Optional[Any]:
        """The StreamOps an offloader gets (None: the offloader's default, torch.cuda's)."""
        return None

    def sleeper(self, cycles: int) -> Callable[[], None]:
        """A delay of the current stream: a kernel that spins ``cycles``."""
        return lambda: torch.cuda._sleep(cycles)

    def side_stream(self, device: torch.device) -> Callable[[], ContextManager]:
        """A non-default compute stream, ordered after what ran so far (the weights'
        initialisation); returns what makes it current for a block."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        return lambda: torch.cuda.stream(side)

    @contextlib.contextmanager
    def sync_debug(self) -> Iterator[List[str]]:
        """Inside: the host synchronisations torch flags (set_sync_debug_mode('warn')), one
        line each, in the yielded list."""
        found: List[str] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield found
            finally:
                torch.cuda.set_sync_debug_mode("default")
        found += [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]

    def total_memory(self, device: torch.device) -> int:
        return torch.cuda.get_device_properties(device).total_memory

    def set_fraction(self, fraction: float, device: torch.device) -> None:
        torch.cuda.set_per_process_memory_fraction(fraction, device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def reset_peak(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def peak(self, device: torch.device) -> Tuple[int, int]:
        """(allocated, reserved) at the peak since reset_peak."""
        return torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device)

    def now(self, device: torch.device) -> Tuple[int, int]:
        """(allocated, reserved) now."""
        return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)

    def stream_ops(self) -> Any:
        """StreamOps for the measure step's own copies (the link's rates: gpu_check_bounds.py)."""
        from ssdtrain_megatron.cache.stream_ops import CudaStreams

        return CudaStreams()

    def timing_ops(self, streams: Optional[Any]) -> Any:
        """The StreamOps whose timing events a point's timeline records: the offloader's own
        (``streams``, what :meth:`streams` gave it) or CUDA's."""
        return streams if streams is not None else self.stream_ops()

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def registration_works(self) -> bool:
        """Whether cudaHostRegister pins here (else pools come from torch's pinned allocator,
        which locks the next power of two: io/pinned.py)."""
        from ssdtrain_megatron.io.pinned import PAGE, RegistrationRefused, pin_exact

        try:
            pin_exact(PAGE)
        except RegistrationRefused:
            return False
        return True


class GradBufferAdam(torch.optim.Adam):
    """Adam whose ``zero_grad`` zeroes the gradients in place instead of freeing them: they stay
    allocated between steps, as Megatron's DDP keeps its gradients in buffers allocated once.
    Memory at a step's start then holds them, and the peak above it is what the step adds."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none=False)


class GpuGPT(MiniGPT):
    """MiniGPT in bf16 with its weights initialised on the device (CPU init of billions of
    parameters takes minutes), with megatron-core's local spec or SDPA core attention."""

    def __init__(self, spec: GPTSpec, device: torch.device, attention: str = "local",
                 grad_buffers: bool = False, sdpa_backend: Optional[str] = None) -> None:
        """``attention``: "local" (megatron-core's local spec, unfused attention) or "sdpa"
        (its core attention on torch's scaled_dot_product_attention: gpu_check_sdpa.py), on
        ``sdpa_backend`` (default: gpu_check_sdpa.choose_backend's, here; ``self.sdpa_backend``
        names it, None with the local spec).
        ``grad_buffers``: Megatron's memory layout for the measure step: gradients allocated
        once (:class:`GradBufferAdam`) and, on CUDA, a fused Adam (torch's default foreach
        Adam allocates temporaries the size of all parameters, which Megatron's fused
        optimizers do not): what a step adds above its start is then its activations'."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig

        self.spec = spec
        self.device = device
        torch.manual_seed(spec.seed)
        model_parallel_cuda_manual_seed(spec.seed, force_reset_rng=True)
        self.config = TransformerConfig(
            num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
            bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
            use_cpu_initialization=False, hidden_dropout=0.0, attention_dropout=0.0,
            bias_dropout_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
            gradient_accumulation_fusion=False, persist_layer_norm=False)
        self.sdpa_backend: Optional[str] = None
        if attention == "sdpa":
            from .gpu_check_sdpa import choose_backend, sdpa_layer_spec

            self.sdpa_backend = sdpa_backend or choose_backend(device, torch.bfloat16, spec.heads,
                                                               spec.hidden // spec.heads)
            layer_spec = sdpa_layer_spec(self.sdpa_backend)
        elif attention == "local":
            layer_spec = get_gpt_layer_local_spec()
        else:
            raise ValueError(f"attention={attention!r}: expected 'local' or 'sdpa'")
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            self.model = GPTModel(config=self.config, transformer_layer_spec=layer_spec,
                                  vocab_size=spec.vocab, max_sequence_length=spec.seq,
                                  share_embeddings_and_output_weights=False, position_embedding_type="rope")
        # All of it in bf16, as Megatron's Float16Module makes it (module.bfloat16()): the local
        # spec's torch norms are created in fp32 whatever params_dtype says, and a CUDA
        # layer_norm refuses bf16 input with fp32 weights (the CPU accepts the mix, which is why
        # only the first GPU run showed it).
        self.model.to(device).bfloat16()
        self.model.train()
        self.params = list(self.model.parameters())
        if grad_buffers:
            self.optimizer = GradBufferAdam(self.params, lr=spec.lr, fused=True if device.type == "cuda" else None)
        else:
            self.optimizer = torch.optim.Adam(self.params, lr=spec.lr)
        self.iteration = 0
        self.set_micro_batch(spec.micro_batch)

    def set_micro_batch(self, mb: int) -> None:
        self.spec = dataclasses.replace(self.spec, micro_batch=mb)
        s = self.spec.seq
        self._mask = torch.ones(1, 1, s, s, dtype=torch.bool, device=self.device).triu(1)
        self._positions = torch.arange(s, device=self.device).unsqueeze(0).expand(mb, s).contiguous()

    def set_recompute(self, full: bool) -> None:
        """Megatron's full recompute (uniform, one layer per checkpoint) on or off; the
        modules share this one TransformerConfig."""
        self.config.recompute_granularity = "full" if full else None
        self.config.recompute_method = "uniform" if full else None
        self.config.recompute_num_layers = 1 if full else None


def bits(t: torch.Tensor) -> torch.Tensor:
    """The integer view of a tensor's bytes (+0.0 and -0.0 differ, as they should)."""
    t = t.detach()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def grads(m: MiniGPT) -> List[Optional[torch.Tensor]]:
    return [None if p.grad is None else bits(p.grad).clone() for p in m.params]


def same(a: List[Optional[torch.Tensor]], b: List[Optional[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                                    for x, y in zip(a, b))


def offload_config(args, engine: str, **kw) -> OffloadConfig:
    """The steps' settings: offload to ``args.scratch`` with ``engine``. Pools are sized by
    the caller to the step (a default 4 GiB host pool would be pinned, and its registration
    timed, for a step that needs a few hundred MiB)."""
    return OffloadConfig(dirs=[args.scratch], engine=engine, **kw)


def deterministic() -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
