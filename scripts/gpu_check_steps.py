"""The steps of `make gpu-check` that need torch and the GPU (see scripts/gpu_check.py).

Each step runs in its own process and returns one dict (``status``: pass, fail, skip); long
steps also ``save`` partial results as they go, so a step killed by its timeout still leaves
what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import io
import json
import os
import subprocess
import sys
import time
import warnings
from typing import Callable, Dict, List, Optional

import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.tools.minigpt import GPTSpec, MegatronRuntime, MiniGPT, installed_step

GiB = 1 << 30
# torch.cuda._sleep cycles put on the compute stream before every layer's forward and backward
# in the bitwise steps (about 5 ms and 2 ms at H200 clocks): the GPU then runs well behind the
# host, so a copy that does not wait for its producer's event, or a staging block handed out
# again before its copy finished, reads or lands the wrong bytes and the comparison fails.
BITWISE_DELAY_CYCLES = 10_000_000
STRESS_DELAY_CYCLES = 4_000_000
BITWISE_SPEC = GPTSpec(layers=4, hidden=1024, heads=16, seq=512, vocab=4096, micro_batch=2, num_microbatches=2)
STRESS_SPEC = GPTSpec(layers=2, hidden=512, heads=8, seq=256, vocab=2048, micro_batch=2, num_microbatches=2)


def deadline_left() -> float:
    return float(os.environ.get("GPU_CHECK_DEADLINE", time.time() + 1e9)) - time.time()


class GpuGPT(MiniGPT):
    """MiniGPT in bf16 with its weights initialised on the GPU (CPU init of billions of
    parameters takes minutes)."""

    def __init__(self, spec: GPTSpec, device: torch.device) -> None:
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
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            self.model = GPTModel(config=self.config, transformer_layer_spec=get_gpt_layer_local_spec(),
                                  vocab_size=spec.vocab, max_sequence_length=spec.seq,
                                  share_embeddings_and_output_weights=False, position_embedding_type="rope")
        self.model.to(device)
        self.model.train()
        self.params = list(self.model.parameters())
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


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


def _grads(m: GpuGPT) -> List[Optional[torch.Tensor]]:
    return [None if p.grad is None else _bits(p.grad).clone() for p in m.params]


def _same(a: List[Optional[torch.Tensor]], b: List[Optional[torch.Tensor]]) -> bool:
    return len(a) == len(b) and all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
                                    for x, y in zip(a, b))


def _config(args, engine: str, **kw) -> OffloadConfig:
    kw.setdefault("host_memory_bytes", 8 * GiB)
    return OffloadConfig(dirs=[args.scratch], engine=engine, **kw)


def _deterministic() -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


# -- steps ----------------------------------------------------------------------------------

def step_env(args, save) -> dict:
    out: Dict[str, object] = {"python": sys.version.split()[0], "torch": torch.__version__,
                              "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    problems = []
    major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    if major_minor < (2, 11):
        problems.append(f"torch {torch.__version__} < 2.11")
    if torch.version.cuda is None or not torch.version.cuda.startswith("13"):
        out["note"] = f"torch built for CUDA {torch.version.cuda}, the wheels carried are cu13"
    if not torch.cuda.is_available():
        problems.append("torch.cuda.is_available() is False")
    else:
        p = torch.cuda.get_device_properties(0)
        out.update(gpu=p.name, gpu_memory_bytes=p.total_memory, gpus=torch.cuda.device_count())
    os.makedirs(args.scratch, exist_ok=True)
    st = os.statvfs(args.scratch)
    out["scratch_free_bytes"] = st.f_bavail * st.f_frsize
    try:
        out["host_memory_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        pass
    out["status"] = "fail" if problems else "pass"
    if problems:
        out["why"] = "; ".join(problems)
    return out


def step_imports(args, save) -> dict:
    """megatron.core and kvikio as this check's steps will import them (the box's packages
    and the bundle installed into <out>/prefix); whether the gds engine can run."""
    out: Dict[str, object] = {}
    try:
        import megatron.core

        out["megatron_core"] = {"version": getattr(megatron.core, "__version__", "?"), "file": megatron.core.__file__}
    except Exception as exc:  # noqa: BLE001 - reported as the reason
        out["megatron_core"] = {"error": f"import megatron.core failed: {exc!r}"[:500]}
    try:
        import kvikio

        from ssdtrain_megatron.io.gds import gds_unavailable_reason

        out["kvikio"] = {"version": getattr(kvikio, "__version__", "?"), "file": kvikio.__file__,
                         "gds_unavailable": gds_unavailable_reason()}
    except Exception as exc:  # noqa: BLE001 - reported as the reason
        out["kvikio"] = {"error": f"import kvikio failed: {exc!r}"[:500]}
    ok = "version" in out["megatron_core"]
    out["status"] = "pass" if ok else "fail"
    if not ok:
        out["why"] = out["megatron_core"]["error"]
    return out


def step_bitwise(args, save, engine: str) -> dict:
    if engine == "gds":
        from ssdtrain_megatron.io.gds import gds_unavailable_reason

        why = gds_unavailable_reason()
        if why:
            return {"status": "skip", "why": why}
        try:
            importlib.import_module("kvikio")  # libkvikio needs rapids-logger and cuFile
        except Exception as exc:  # noqa: BLE001 - reported as the reason
            return {"status": "skip", "why": f"kvikio is installed but does not import: {exc!r}"[:500]}
    if engine == "aio":
        from ssdtrain_megatron.io.aio import aio_unavailable_reason

        why = aio_unavailable_reason()
        if why:
            return {"status": "skip", "why": why}
    _deterministic()
    kw = {"host_memory_bytes": 64 << 20} if engine == "tiered" else {}
    cfg = _config(args, engine, min_tensor_bytes=64 * 1024, max_inflight_bytes=256 << 20, **kw)
    return _compare(args, save, BITWISE_SPEC, cfg, steps=3, stream=None, delay=_sleeper(BITWISE_DELAY_CYCLES))


def step_stress(args, save) -> dict:
    _deterministic()
    cfg = _config(args, "posix", min_tensor_bytes=16 * 1024, max_inflight_bytes=64 << 20, keep_last_layers=0)
    return _compare(args, save, STRESS_SPEC, cfg, steps=100, stream="side", delay=_sleeper(STRESS_DELAY_CYCLES))


def _sleeper(cycles: int) -> Optional[Callable[[], None]]:
    """A delay of the current CUDA stream (a kernel that spins ``cycles``), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return lambda: torch.cuda._sleep(cycles)


def delay_compute(model: MiniGPT, delay: Callable[[], None], count: Dict[str, int]) -> list:
    """Run ``delay`` on the current stream before each transformer layer's forward, and in
    backward when the gradient of the layer's input is computed (before the layer below
    runs its backward); count both in ``count``. Returns the hook handles."""

    def fwd(module, args, kwargs):
        hs = kwargs.get("hidden_states", args[0] if args else None)
        count["forward"] += 1
        delay()
        if isinstance(hs, torch.Tensor) and hs.requires_grad:
            hs.register_hook(bwd)

    def bwd(grad):
        count["backward"] += 1
        delay()

    return [layer.register_forward_pre_hook(fwd, with_kwargs=True) for layer in model.model.decoder.layers]


def _compare(args, save, spec: GPTSpec, cfg: OffloadConfig, steps: int, stream: Optional[str],
             delay: Optional[Callable[[], None]] = None) -> dict:
    """keep, keep again (is the baseline itself deterministic?) and offload, step by step,
    each with the compute stream delayed by ``delay`` (see delay_compute) where given."""
    from ssdtrain_megatron.cache import device_copy

    compact = {"n": 0, "all": 0}
    real_stage_out = device_copy.DeviceCopy.stage_out

    def counting_stage_out(self, rec):
        compact["all"] += 1
        compact["n"] += bool(rec.compact)
        return real_stage_out(self, rec)

    device_copy.DeviceCopy.stage_out = counting_stage_out
    result: Dict[str, object] = {"engine": cfg.engine, "steps": steps, "spec": dataclasses.asdict(spec)}
    with MegatronRuntime() as rt:
        models = {n: GpuGPT(spec, rt.device) for n in ("keep", "keep2", "offload")}
        delays = {"forward": 0, "backward": 0}
        hooks = [h for m in models.values() for h in (delay_compute(m, delay, delays) if delay else [])]
        init_same = all(_same([_bits(p) for p in models["keep"].params], [_bits(p) for p in m.params])
                        for m in models.values())
        offs = {"keep": ActivationOffloader(cfg.replace(policy="keep", job="gc-keep"), device=rt.device),
                "keep2": ActivationOffloader(cfg.replace(policy="keep", job="gc-keep2"), device=rt.device),
                "offload": ActivationOffloader(cfg.replace(job="gc-offload"), device=rt.device)}
        side = torch.cuda.Stream(rt.device) if stream else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(rt.device))  # the weights' initialisation
        mismatch, baseline_mismatch = [], []
        read = written = 0
        try:
            for i in range(steps):
                got = {}
                for n in models:
                    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                        loss, _ = installed_step(models[n], offs[n])
                    got[n] = (torch.tensor([loss], dtype=torch.float64).view(torch.int64).item(), _grads(models[n]))
                st = offs["offload"].last_step_stats
                read += st.bytes_read
                written += st.bytes_offloaded
                if got["keep"][0] != got["keep2"][0] or not _same(got["keep"][1], got["keep2"][1]):
                    baseline_mismatch.append(i)
                if got["keep"][0] != got["offload"][0] or not _same(got["keep"][1], got["offload"][1]):
                    mismatch.append(i)
                if deadline_left() < 5:
                    result["stopped_early_at_step"] = i + 1
                    break
        finally:
            for o in offs.values():
                o.close()
            for h in hooks:
                h.remove()
            device_copy.DeviceCopy.stage_out = real_stage_out
    result.update(init_same=init_same, steps_differing=mismatch[:20], baseline_steps_differing=baseline_mismatch[:20],
                  bytes_written=written, bytes_read=read, tensors_staged=compact["all"], compact_tensors=compact["n"],
                  compute_delays=delays)
    if not init_same:
        result.update(status="fail", why="models built with one seed differ: no comparison possible")
    elif baseline_mismatch:
        result.update(status="fail", why=f"keep vs keep already differs at steps {baseline_mismatch[:5]}: "
                      "the baseline is not deterministic here, so bitwise checks are inconclusive")
    elif mismatch:
        result.update(status="fail", why=f"offload differs from keep at steps {mismatch[:5]}")
    elif read == 0:
        result.update(status="fail", why="nothing was read back from the engine: offload did not happen")
    elif delay is not None and not (delays["forward"] and delays["backward"]):
        result.update(status="fail", why=f"the compute stream was not delayed in forward and backward: {delays}")
    elif stream and compact["n"] == 0:
        result.update(status="fail", why="no compact view was offloaded (the stress needs some)")
    else:
        result.update(status="pass", summary=f"{result.get('stopped_early_at_step', steps)} steps, "
                      f"{read / 1e9:.2f} GB read back, {compact['n']}/{compact['all']} compact, "
                      f"compute delayed {delays['forward']} + {delays['backward']} times")
    return result


def step_cuda_tests(args, save) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # The whole suite, so that every cuda-marked test anywhere runs (new ones included).
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rs", "tests"]
    proc = subprocess.run(cmd, cwd=repo, capture_output=True, text=True,
                          timeout=max(10, deadline_left() - 3))
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    summary = tail[-1] if tail else ""
    out = {"summary": summary, "tail": tail, "rc": proc.returncode}
    if proc.returncode == 0 and " passed" in summary:
        return dict(out, status="pass")
    if proc.returncode in (0, 5):  # all skipped, or none collected: nothing was proven
        return dict(out, status="skip", why=f"no cuda test ran: {summary}")
    return dict(out, status="fail", why=f"pytest -m cuda exit status {proc.returncode}: {summary}")


def step_syncs(args, save) -> dict:
    """Synchronisations flagged by torch.cuda.set_sync_debug_mode('warn') on the training
    thread (backward's warnings are re-raised there), per step, after two warm-up steps."""
    _deterministic()
    cfg = _config(args, "memory", min_tensor_bytes=64 * 1024, max_inflight_bytes=256 << 20, host_memory_bytes=4 * GiB)
    counts, examples = {}, {}
    with MegatronRuntime() as rt:
        for name, policy in (("keep", "keep"), ("offload", "offload")):
            model = GpuGPT(BITWISE_SPEC, rt.device)
            off = ActivationOffloader(cfg.replace(policy=policy, job=f"gc-sync-{name}"), device=rt.device)
            try:
                for _ in range(2):
                    installed_step(model, off)
                n_steps = 3
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    torch.cuda.set_sync_debug_mode("warn")
                    try:
                        for _ in range(n_steps):
                            installed_step(model, off)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
                counts[name] = len(syncs) / n_steps
                examples[name] = sorted(set(syncs))[:5]
            finally:
                off.close()
            del model
            gc.collect()
            torch.cuda.empty_cache()
    ok = counts["offload"] <= counts["keep"]
    return {"status": "pass" if ok else "fail", "keep_syncs": counts["keep"], "offload_syncs": counts["offload"],
            "examples": examples,
            **({} if ok else {"why": f"offload adds {counts['offload'] - counts['keep']:.1f} syncs per step"})}


def step_io_bench(args, save) -> dict:
    from ssdtrain_megatron.tools.cli import main as cli

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli(["io-bench", "--dir", args.scratch, "--engine", "posix", "--total-gb", "4", "--rounds", "1",
                  "--json", "--quiet"])
    if rc != 0:
        return {"status": "fail", "why": f"io-bench exit status {rc}"}
    report = json.loads(buf.getvalue().strip().splitlines()[-1])
    eng = report.get("engines", {}).get("posix", {})
    return {"status": "pass", "baseline": report.get("baseline"), "posix": eng, "report": report}


def run_step(args: argparse.Namespace, save: Callable[[dict], None]) -> dict:
    name = args.child
    if name == "env":
        return step_env(args, save)
    if not torch.cuda.is_available():
        return {"status": "skip", "why": "no CUDA device"}
    if name.startswith("bitwise-"):
        return step_bitwise(args, save, name.split("-", 1)[1])
    if name == "measure":
        from gpu_check_measure import step_measure  # scripts/gpu_check_measure.py

        return step_measure(args, save)
    fn = {"imports": step_imports, "stress": step_stress, "cuda-tests": step_cuda_tests, "syncs": step_syncs,
          "io-bench": step_io_bench}.get(name)
    if fn is None:
        raise ValueError(f"unknown step {name!r}")
    return fn(args, save)
