"""Train tiny models with DeepSpeed's engines on CPU in real gloo processes, for the tests.

``run(spec, workdir)`` starts ``spec.world_size`` processes the way a launcher does (MASTER_ADDR,
MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK), each calls ``deepspeed.init_distributed("gloo")``
and trains every phase of ``spec`` in turn, rebuilding model and engine from the same seed:

* ``spec.engine == "pipeline"``: a ``PipelineModule`` of ``num_layers`` small transformer layers
  over ``world_size`` stages, trained with ``PipelineEngine.train_batch`` (``gas`` micro-batches
  per step), then ``eval_batch`` once;
* ``spec.engine == "engine"``: a plain module (input projection, transformer layers, MSE loss)
  trained with ``DeepSpeedEngine`` forward / backward / step per micro-batch; with
  ``Phase.checkpoint`` the layers run under ``deepspeed.checkpointing.checkpoint``, configured
  per phase (partition_activations / cpu_checkpointing / contiguous memory), with all ranks as
  one tensor-parallel group (each rank holds the same activations, as TP ranks do, so
  partitioned checkpoints are gathered back across the group).

A phase with ``offload`` installs ``ssdtrain_megatron.megatron.deepspeed`` first and uninstalls it
after. Each rank returns its losses, the gradients of every step (taken right before the
optimizer step), the final parameters and, for offload phases, what the offloader saw.

The layer class is named ``ParallelTransformerLayer``, like Megatron-DeepSpeed's, so the
integration's default (match by class name) applies to it.

DeepSpeed's CPU accelerator JIT-compiles a shared-memory all-reduce op
(``deepspeed_shm_comm``) in ``init_distributed`` (about 2 minutes on 2 cores, once per
machine); these runs use gloo collectives only, so the workers skip that build.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch
from torch import nn

from bitwise import bitwise_equal
from exactness import ExactnessOracle
from ranks import run_ranks
from settle_writes import settle_writes_before_backward


@dataclass
class Phase:
    name: str
    offload: Optional[Dict[str, Any]] = None
    """OffloadConfig keyword arguments ("{root}" in dirs: the run's offload root); None: plain."""
    checkpoint: int = 0
    """Layers per activation checkpoint (PipelineModule's activation_checkpoint_interval, or
    layers per deepspeed.checkpointing.checkpoint call); 0: none."""
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous: bool = False
    layer_classes: Optional[List[str]] = None
    """install(layer_classes=...); None: the default."""
    loss: str = "mse"
    """Pipeline engines: "mse" (float labels, nothing of them saved) or "cross_entropy"
    (class labels, which the loss saves for backward: pipe_buffers holds them until then)."""
    settle_writes: bool = True
    """Offload phases: every queued write finishes before a backward is announced (as the
    megatron harness's Phase.settle_writes). A write still queued when backward wants its
    tensor is taken back, so without this what a step writes, reads and wastes depends on how
    far the IO threads got on a loaded 2-core machine."""


@dataclass
class Spec:
    engine: str = "pipeline"
    world_size: int = 2
    model_parallel: int = 1
    """Pipeline engines: ranks per stage in the topology's "model" axis (world_size /
    model_parallel stages). Above 1 the engine partitions what stages send each other
    (``is_pipe_partitioned``); the toy layers are not split, each such rank computes the same."""
    num_layers: int = 6
    hidden: int = 32
    heads: int = 4
    seq: int = 16
    micro_batch_size: int = 2
    gas: int = 4
    steps: int = 3
    seed: int = 1234
    dropout: float = 0.1
    lr: float = 0.01
    device: str = "cpu"
    """"cpu" (DeepSpeed's CPU accelerator, gloo) or "cuda" (one GPU per rank, nccl)."""
    phases: List[Phase] = field(default_factory=lambda: [Phase("plain")])
    timeout_s: float = 240.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        data = json.loads(text)
        data["phases"] = [Phase(**p) for p in data["phases"]]
        return cls(**data)


# -- the model ---------------------------------------------------------------------------------


class ParallelTransformerLayer(nn.Module):
    """A small pre-LayerNorm transformer layer on [batch, seq, hidden] (causal attention,
    GELU MLP, dropout), named like Megatron-DeepSpeed's layer."""

    def __init__(self, hidden: int, heads: int, dropout: float, layer_number: Optional[int] = None):
        super().__init__()
        if layer_number is not None:
            self.layer_number = layer_number
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        attn = self.drop(scores.masked_fill(mask, float("-inf")).softmax(-1))
        x = x + self.drop(self.proj((attn @ v).transpose(1, 2).reshape(b, s, h)))
        return x + self.drop(self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x)))))


def mse(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return ((output - labels) ** 2).mean()


class Net(nn.Module):
    """Input projection, transformer layers (optionally under deepspeed.checkpointing), loss."""

    def __init__(self, spec: Spec, checkpoint: int):
        super().__init__()
        self.embed = nn.Linear(spec.hidden, spec.hidden)
        self.layers = nn.ModuleList(
            ParallelTransformerLayer(spec.hidden, spec.heads, spec.dropout, layer_number=i + 1)
            for i in range(spec.num_layers))
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        import deepspeed

        h = self.embed(x)
        if not self.checkpoint:
            for layer in self.layers:
                h = layer(h)
        else:
            for start in range(0, len(self.layers), self.checkpoint):
                run = self._chunk(start, start + self.checkpoint)
                h = deepspeed.checkpointing.checkpoint(run, h)
        return mse(h, labels)

    def _chunk(self, start: int, end: int):
        def run(h):
            for layer in self.layers[start:end]:
                h = layer(h)
            return h

        return run


def cross_entropy(output: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each position's hidden vector as logits over ``hidden`` classes; ``labels`` one class
    per position, flat, so the loss saves the very tensor pipe_buffers holds."""
    return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]), labels)


def make_batches(spec: Spec, step: int, loss: str = "mse") -> List[tuple]:
    gen = torch.Generator().manual_seed(spec.seed * 1000 + step)
    shape = (spec.micro_batch_size, spec.seq, spec.hidden)
    if loss == "cross_entropy":
        return [(torch.randn(shape, generator=gen),
                 torch.randint(0, spec.hidden, (shape[0] * shape[1],), generator=gen))
                for _ in range(spec.gas)]
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
            for _ in range(spec.gas)]


class TensorParallelGroup:
    """The few mpu methods deepspeed.checkpointing.configure() reads: all ranks, one group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.group = dist.new_group(list(range(dist.get_world_size())))
        self.rank, self.size = dist.get_rank(), dist.get_world_size()

    def get_tensor_model_parallel_rank(self):
        return self.rank

    def get_tensor_model_parallel_world_size(self):
        return self.size

    def get_tensor_model_parallel_group(self):
        return self.group

    def get_data_parallel_rank(self):
        return 0


# -- parent side --------------------------------------------------------------------------------


def run(spec: Spec, workdir: str) -> List[Dict[str, Any]]:
    """Run every phase of ``spec``; the result of each rank, ordered by rank."""
    return run_ranks("deepspeed_harness", spec.to_json(), spec.world_size, spec.timeout_s, workdir,
                     extra_env={"DS_ACCELERATOR": spec.device})


# -- worker side --------------------------------------------------------------------------------


def _worker_main() -> None:
    spec_path, workdir = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = Spec.from_json(f.read())
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    import importlib

    import deepspeed
    import torch.distributed as dist

    # gloo only: skip the JIT build (see the module docstring). deepspeed.comm's namespace has
    # a `torch` attribute of its own, hence import_module rather than `import ... as`.
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if spec.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if spec.device == "cuda" else "gloo")
    rank = dist.get_rank()
    tp = TensorParallelGroup() if spec.engine == "engine" else None
    result = {"rank": rank, "phases": {}}
    for phase in spec.phases:
        result["phases"][phase.name] = _train_phase(spec, phase, workdir, tp)
        dist.barrier()
    tmp = os.path.join(workdir, f"result{rank}.pt.tmp")
    torch.save(_to_cpu(result), tmp)
    os.replace(tmp, os.path.join(workdir, f"result{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


class _Offload:
    """install() / uninstall() around one phase, and what the offloader did."""

    def __init__(self, phase: Phase, workdir: str) -> None:
        from ssdtrain_megatron import OffloadConfig
        from ssdtrain_megatron.megatron import deepspeed as integration

        self.integration = integration
        self.root = os.path.join(workdir, "offload_root")
        kwargs = dict(phase.offload)
        kwargs["dirs"] = [d.replace("{root}", self.root) for d in kwargs.get("dirs", ["{root}"])]
        for d in kwargs["dirs"]:  # the drives, mounted: the part of each template above {job}
            os.makedirs(d.split("{job}")[0], exist_ok=True)
        # Every tensor the offloader packs is compared with what it unpacks (tests/exactness.py);
        # differences() reports a mismatch like a differing gradient.
        self.oracle = ExactnessOracle().__enter__()
        try:
            self.offloader = integration.install(OffloadConfig(**kwargs),
                                                 layer_classes=phase.layer_classes)
        except BaseException:
            self.oracle.__exit__(None, None, None)
            raise
        if phase.settle_writes:
            settle_writes_before_backward(self.offloader)
        self.rank_dirs = [os.path.realpath(d) for d in self.offloader.rank_dirs]
        self.steps: List[Dict[str, Any]] = []
        self.hints: List[list] = []
        self.files_after_step: List[list] = []

    def end_of_step(self) -> None:
        stats = self.offloader.last_step_stats
        self.steps.append(stats.as_dict() if stats is not None else None)
        self.hints.append(list(self.integration.installed().pipeline.hints))
        files = []  # (path, size, allocated bytes) of this rank's files
        for d in self.rank_dirs:
            for dirpath, _, names in os.walk(d):
                for n in names:
                    st = os.stat(os.path.join(dirpath, n))
                    files.append((os.path.join(dirpath, n), st.st_size, st.st_blocks * 512))
        self.files_after_step.append(sorted(files))

    def finish(self) -> Dict[str, Any]:
        inst = self.integration.installed()
        info = {
            "rank_dirs": self.rank_dirs,
            "steps": self.steps,
            "hints": self.hints,
            "files_after_step": self.files_after_step,
            "mispredictions": inst.pipeline.mispredictions,
            "steps_planned": inst.pipeline.steps_planned,
            "checkpoints_routed": inst.scopes.checkpoints_routed,
            "patched_classes": [c.__name__ for c in inst.scopes.patched],
            "last_step": getattr(self.offloader.last_step_stats, "step", None),
        }
        self.integration.uninstall()
        self.oracle.__exit__(None, None, None)
        info["exactness"] = self.oracle.report()
        left = []
        for d in self.rank_dirs:
            for dirpath, _, names in os.walk(d):
                left.extend(os.path.join(dirpath, n) for n in names)
        info["files_after_close"] = left
        info["dirs_after_close"] = [d for d in self.rank_dirs if os.path.exists(d)]
        return info


def _train_phase(spec: Spec, phase: Phase, workdir: str, tp) -> Dict[str, Any]:
    import deepspeed

    offload = _Offload(phase, workdir) if phase.offload is not None else None
    try:
        torch.manual_seed(spec.seed)
        if spec.engine in ("pipeline", "dualpipev"):
            out = _train_pipeline(spec, phase, offload)
        else:
            deepspeed.checkpointing.configure(
                tp, partition_activations=phase.partition_activations,
                checkpoint_in_cpu=phase.cpu_checkpointing,
                contiguous_checkpointing=phase.contiguous,
                num_checkpoints=spec.num_layers // max(phase.checkpoint, 1))
            out = _train_engine(spec, phase, offload)
        out["offload"] = offload.finish() if offload is not None else {}
        return out
    except BaseException:
        if offload is not None:
            offload.integration.uninstall()
            offload.oracle.__exit__(None, None, None)
        raise


def _ds_config(spec: Spec, data_parallel: int) -> Dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": spec.micro_batch_size,
            "gradient_accumulation_steps": spec.gas,
            "train_batch_size": spec.micro_batch_size * spec.gas * data_parallel,
            "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def _grad_capture(optimizer: torch.optim.Optimizer, named, grads: List[Dict[str, torch.Tensor]]):
    def capture(opt, args, kwargs):
        grads.append({n: p.grad.detach().clone() for n, p in named if p.grad is not None})

    optimizer.register_step_pre_hook(capture)


def _train_pipeline(spec: Spec, phase: Phase, offload: Optional[_Offload]) -> Dict[str, Any]:
    import deepspeed
    from deepspeed.pipe import DualPipeVModule, LayerSpec, PipelineModule

    layers = [LayerSpec(ParallelTransformerLayer, spec.hidden, spec.heads, spec.dropout)
              for _ in range(spec.num_layers)]
    module_cls = DualPipeVModule if spec.engine == "dualpipev" else PipelineModule
    layout: Dict[str, Any] = {"num_stages": spec.world_size}
    if spec.model_parallel > 1:
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        layout = {"topology": PipeModelDataParallelTopology(
            num_pp=spec.world_size // spec.model_parallel, num_mp=spec.model_parallel, num_dp=1)}
    loss_fn = cross_entropy if phase.loss == "cross_entropy" else mse
    model = module_cls(layers=layers, loss_fn=loss_fn, partition_method="uniform",
                       activation_checkpoint_interval=phase.checkpoint, **layout)
    named = list(model.named_parameters())
    optimizer = torch.optim.SGD([p for _, p in named], lr=spec.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config=_ds_config(spec, 1))
    grads: List[Dict[str, torch.Tensor]] = []
    _grad_capture(optimizer, named, grads)
    losses, mb_losses = [], []
    for step in range(spec.steps):
        losses.append(engine.train_batch(iter(make_batches(spec, step, phase.loss))).detach().clone())
        mb_losses.append([t.clone() for t in engine.fwd_outputs])  # empty but on the loss stage
        if offload is not None:
            offload.end_of_step()
    eval_loss = engine.eval_batch(iter(make_batches(spec, spec.steps, phase.loss)))
    return {"losses": losses, "microbatch_losses": mb_losses, "grads": grads,
            "eval_loss": eval_loss.detach().clone(),
            "params": {n: p.detach().clone() for n, p in named}}


def _train_engine(spec: Spec, phase: Phase, offload: Optional[_Offload]) -> Dict[str, Any]:
    import deepspeed

    model = Net(spec, phase.checkpoint)
    named = list(model.named_parameters())
    optimizer = torch.optim.SGD([p for _, p in named], lr=spec.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer,
                                           config=_ds_config(spec, spec.world_size))
    grads: List[Dict[str, torch.Tensor]] = []
    _grad_capture(optimizer, named, grads)
    losses = []
    for step in range(spec.steps):
        step_losses = []
        for x, y in make_batches(spec, step):
            loss = engine(x.to(engine.device), y.to(engine.device))
            step_losses.append(loss.detach().clone())
            engine.backward(loss)
            engine.step()
        losses.append(step_losses)
        if offload is not None:
            offload.end_of_step()
    return {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in named}}


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


# -- comparisons --------------------------------------------------------------------------------


def differences(a: Dict[str, Any], b: Dict[str, Any]) -> List[str]:
    """Every way two phase results differ bitwise (losses, gradients, parameters), and every
    tensor an offload phase restored with other bytes than it packed (the exactness oracle)."""
    diffs: List[str] = [m for r in (a, b) for m in r.get("offload", {}).get("exactness", {}).get("mismatches", [])[:5]]
    for r in (a, b):
        ex, steps = r.get("offload", {}).get("exactness"), r.get("offload", {}).get("steps", [])
        if ex is not None and any(st and st.get("bytes_read") for st in steps) and not ex["compared_offloaded"]:
            diffs.append(f"bytes were read back but the exactness oracle compared none: {ex}")

    def same(x, y) -> bool:
        if isinstance(x, torch.Tensor):
            return isinstance(y, torch.Tensor) and x.dtype == y.dtype and bitwise_equal(x, y)
        if isinstance(x, (list, tuple)):
            return isinstance(y, (list, tuple)) and len(x) == len(y) and all(map(same, x, y))
        if isinstance(x, dict):
            return isinstance(y, dict) and x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
        return x == y

    for what in ("losses", "microbatch_losses", "eval_loss", "params"):
        if what in a and not same(a[what], b.get(what)):
            diffs.append(f"{what} differ")
    if len(a["grads"]) != len(b["grads"]):
        diffs.append(f"{len(a['grads'])} optimizer steps != {len(b['grads'])}")
    for step, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
        for name in sorted(set(ga) | set(gb)):
            if name not in ga or name not in gb or not bitwise_equal(ga[name], gb[name]):
                diffs.append(f"step {step}: gradient of {name} differs")
    return diffs


if __name__ == "__main__":
    _worker_main()
