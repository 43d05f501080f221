"""The time plan of `make gpu-check` (gpu_check.py): the steps, their limits, and what
each is expected to take on the box, the pinning of its pools and the collection of its tests
included; and the shapes and pool sizes the steps use, so that the plan and the steps cannot
disagree. No torch here: the plan prints anywhere (`GPU_CHECK_DRY=1 make gpu-check`).

Every estimate is start + registration + collection + work, at the conservative rates of
ASSUME; a step fits when its estimate is within its limit, and the plan fits when every step
fits and the limits add up to the total less the parent's share.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from .gpu_check_optimizer import estimate as optimizer_estimate
from .gpu_drive import RAW_MAX_BYTES

MiB = 1 << 20
GiB = 1 << 30

# (name, time limit in seconds, the steps it needs to have passed, what it does). Order =
# priority: what matters most runs first.
STEPS = [
    ("env", 15, (), "python, torch, CUDA and GPU versions; free disk"),
    ("install", 35, ("env",), "pip install --no-index the bundle (.whl) into <out>/prefix"),
    ("imports", 20, ("install",), "import megatron.core and kvikio (and its mode); the gds engine available?"),
    ("bitwise-posix", 30, ("imports",), "GPT bf16, keep vs offload (posix), delayed compute: bitwise"),
    ("bitwise-memory", 30, ("imports",), "GPT bf16, keep vs offload (memory), delayed compute: bitwise"),
    ("bitwise-tiered", 30, ("imports",), "GPT bf16, keep vs offload (tiered), delayed compute: bitwise"),
    ("bitwise-gds", 30, ("imports",), "the same with gds through GPUDirect Storage (not run in compat mode)"),
    ("bitwise-gds-compat", 30, ("imports",), "the same with gds in kvikio's compat mode (KVIKIO_COMPAT_MODE=ON)"),
    ("stress", 35, ("imports",), "50 steps, delayed side compute stream, compact views: bitwise"),
    ("cuda-tests", 35, ("install",), "the cuda tests this box can run (gpu_check_cuda.py): all pass"),
    ("syncs", 26, ("imports",), "host syncs on the training thread, offload (memory) vs keep"),
    ("optimizer-offload", 34, ("imports",), "megatron-core's optimizer CPU offload with ours (tiered), through the "
                                            "launcher: pools, pinned memory, bitwise, the optimizer step vs the plan"),
    ("measure", 130, ("imports",), "per policy: peak activation memory, step time against its bound, stall"),
]
# 490: the optimizer-offload row's 34 s came from 10 more here and 5 each off env, stress and
# cuda-tests and 9 off measure, each still at least its estimate before its SIGTERM; within
# 480 s of limits, what one 10-minute device call holds with 2 minutes for the transfers.
TOTAL_S = 490  # the whole check, the parent's own work included
# A step over its limit (gpu_check.py run_child): SIGTERM, then SIGKILL TERM_WAIT_S
# later, then KILL_WAIT_S at most for the process to go. The SIGTERM comes KILL_GRACE_S before
# the limit, so the kill path ends within it; a step's estimate must fit before the SIGTERM.
# The child's own deadline (GPU_CHECK_DEADLINE) is DEADLINE_MARGIN_S before the SIGTERM.
TERM_WAIT_S, KILL_WAIT_S = 3, 2
KILL_GRACE_S = TERM_WAIT_S + KILL_WAIT_S
DEADLINE_MARGIN_S = 1
PARENT_RUNS = ("install",)  # steps the parent runs itself (pip, under its own timeout): no kill path
PARENT_S = 10  # the parent's share: starting the steps, writing the results
# What the estimates assume (conservative for an H200 box): the drive's bandwidth each way,
# the pinned host link, sustained bf16 matmul rate; a step process's start with torch and CUDA
# (``torch_start_s``) and with megatron-core and its models too (``start_s``); cudaHostRegister
# of fresh memory (faulting the pages in, then locking them); pytest's start and collection of
# the cuda-tests files (4 s of CPU on this project's 2-core CI machine: 15 s allowed); pip
# installing the bundle offline; the required cuda tests themselves (28, about half a second
# each: their delays are 0.1-0.25 s sleeps); and what torch.cuda._sleep cycles cost (about 2 GHz).
# ``sdpa_first_s``: a shape on SDPA attention chooses its backend (a small forward and backward
# per backend tried: gpu_check_sdpa.py) and its first step builds the kernel's plan
# (cuDNN attention builds a graph per shape, seconds; flash compiles nothing at run time).
# ``build_bps``: building a shape's model on the GPU, its weights initialised and its gradient
# buffers and Adam state allocated (8 bytes a parameter; 59 GB at the compute-bound shape).
# ``te_import_s``: importing Transformer Engine (its CUDA libraries) beside megatron-core, for
# the optimizer-offload step (gpu_check_optimizer.py).
ASSUME = {"drive_bps": 1.0e9, "link_bps": 10e9, "flops": 100e12, "start_s": 20.0, "torch_start_s": 10.0,
          "register_bps": 2.0e9, "collect_s": 15.0, "pip_s": 25.0, "cuda_tests_s": 15.0, "cycle_s": 0.5e-9,
          "sdpa_first_s": 5.0, "build_bps": 20e9, "te_import_s": 5.0}
# The cards the device machines lend, with the GPU memory a process sees on each (about 78 GiB
# of an H100's 80 GB, 139 GiB of an H200's 141 GB) and the host RAM beside them. ASSUME's rates
# are below both (sm90, the same bf16 matmul rate and a PCIe Gen5 link on each), so the time
# plan is the same on either; what differs is whether each shape's memory fits
# (:func:`card_check`). The plan assumes the smaller, and the dry run checks both.
CARDS = {"H100 80 GB": {"gpu_bytes": 78 * (1 << 30), "host_bytes": 128 * (1 << 30)},
         "H200 141 GB": {"gpu_bytes": 139 * (1 << 30), "host_bytes": 128 * (1 << 30)}}
ASSUMED_CARD = "H100 80 GB"

# The bitwise and stress steps' model and schedule (GPTSpec fields), and their compute delays:
# torch.cuda._sleep cycles on the compute stream before every layer's forward and backward
# (about 5 ms and 2 ms), so that the GPU runs well behind the host and a copy that does not
# wait for its producer's event, or a staging block handed out again before its copy finished,
# reads or lands the wrong bytes.
BITWISE_SHAPE = dict(layers=4, hidden=1024, heads=16, seq=512, vocab=4096, micro_batch=2, num_microbatches=2)
STRESS_SHAPE = dict(layers=2, hidden=512, heads=8, seq=256, vocab=2048, micro_batch=2, num_microbatches=2)
BITWISE_STEPS, STRESS_STEPS = 3, 50  # stress: the first GPU run got through 50 of 100 in its 40 s
BITWISE_DELAY_CYCLES, STRESS_DELAY_CYCLES = 10_000_000, 4_000_000
BITWISE_INFLIGHT = 256 * MiB
STRESS_INFLIGHT = 64 * MiB
MEASURE_INFLIGHT = GiB
LINK_BYTES = 512 * MiB  # one link measurement, each way (gpu_check_bounds.py)
OVERFLOW_STAGING = 64 * MiB  # the staging of an engine that copies into its own pool (memory)
ADAPTIVE_TRIAL_STEPS, ADAPTIVE_EXPLORE_STEPS = 1, 3  # the measure step's adaptive: settles fast
# Warm-up steps at most before its timed steps: one before anything went through the drive
# (no bandwidth to plan with), one making the model's plan, one re-plan while the plan is
# measured (cache/adaptive.py), then one round of measured selection (plan/explore.py's
# Bounds.round_steps; this module imports nothing of the package, which the parent process
# cannot import: tests/test_gpu_check.py checks that the two agree).
ADAPTIVE_SETTLE_CAP = 3 + ADAPTIVE_TRIAL_STEPS + 2 * ADAPTIVE_EXPLORE_STEPS


def activation_bytes(shape: dict, micro_batch: Optional[int] = None) -> int:
    """bf16 activations of one micro-batch: L b (34 s h + 5 a s^2) bytes (Korthikanti et al.);
    without the 5 a s^2 of the softmax and probabilities with fused (SDPA) attention
    (``shape["attention"] == "sdpa"``)."""
    b = shape["micro_batch"] if micro_batch is None else micro_batch
    s, h, a = shape["seq"], shape["hidden"], shape["heads"]
    quadratic = 0 if shape.get("attention") == "sdpa" else 5 * a * s * s
    return shape["layers"] * b * (34 * s * h + quadratic)


def parameters(shape: dict) -> int:
    """12 h^2 + 13 h per layer, and the untied embedding and output layer."""
    h = shape["hidden"]
    return shape["layers"] * (12 * h * h + 13 * h) + 2 * shape["vocab"] * h


def save_on_cpu_bytes(shape: dict, micro_batch: int) -> int:
    """What torch's save_on_cpu copies to host memory in a step: every saved tensor, the
    activations and the bf16 weights the linear layers save for backward."""
    return activation_bytes(shape, micro_batch) + 2 * parameters(shape)


def round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def memory_pool_bytes(microbatch_bytes: float) -> int:
    """A host pool for one micro-batch's offloaded activations (the others' are released by
    their backward before the next forward), with a quarter of slack."""
    return round_up(int(1.25 * microbatch_bytes) + 64 * MiB, 64 * MiB)


def bitwise_settings(engine: str) -> dict:
    """OffloadConfig fields of a bitwise step, its pools sized to the step."""
    kw = dict(min_tensor_bytes=64 * 1024, max_inflight_bytes=BITWISE_INFLIGHT)
    if engine == "memory":
        kw.update(host_memory_bytes=memory_pool_bytes(activation_bytes(BITWISE_SHAPE)),
                  pinned_staging_bytes=OVERFLOW_STAGING)
    elif engine == "tiered":
        kw.update(host_memory_bytes=64 * MiB)  # small: most of it spills to the SSD tier
    return kw


def pinned_bytes(engine: str, settings: dict, direct: bool = False) -> int:
    """Host memory an offloader with these settings pins at its start: the staging pool
    (none for gds through GPUDirect Storage) and the memory engine's (or tier's) pool."""
    staging = 0 if direct else settings.get("pinned_staging_bytes") or 2 * settings.get("max_inflight_bytes", GiB)
    pool = settings.get("host_memory_bytes", 4 * GiB) if engine in ("memory", "tiered") else 0
    return staging + pool


def _compute_s(shape: dict, mb: int, recompute: bool = False) -> float:
    """Seconds of one step's matmuls: 72 b s L h^2 (1 + s / 6h) per micro-batch, 4/3 with full recompute."""
    s, h = shape["seq"], shape["hidden"]
    flops = 72 * mb * s * shape["layers"] * h * h * (1 + s / (6 * h)) * shape.get("num_microbatches", 1)
    return flops * (4 / 3 if recompute else 1) / ASSUME["flops"]


def _delays_s(shape: dict, steps: int, cycles: int, models: int = 3) -> float:
    """The compute delays of a comparison: every layer's forward and backward, per micro-batch,
    per model, per step."""
    return models * steps * shape["num_microbatches"] * shape["layers"] * 2 * cycles * ASSUME["cycle_s"]


def _comparison(shape: dict, steps: int, cycles: int, pinned: int) -> Dict[str, float]:
    moved = 2 * activation_bytes(shape) * shape["num_microbatches"] * steps  # written, then read back
    work = 3 * steps * _compute_s(shape, shape["micro_batch"]) + _delays_s(shape, steps, cycles) \
        + moved / ASSUME["drive_bps"]
    return {"start": ASSUME["start_s"], "register": pinned / ASSUME["register_bps"], "work": work}


def measure_points(args) -> List[dict]:
    """The measure step's points in order, with the steps each runs (warm-up and timed), for the
    estimate (the step itself sizes its memory pools from what keep measured)."""
    k = args.micro_batch
    return point_plan(measure_shape(args), (("keep", k, None), ("offload-memory", k, "memory"),
                                            ("offload-posix", k, "posix"), ("recompute", k, None),
                                            ("keep", k + 1, None), ("recompute", k + 1, None),
                                            ("adaptive", k + 1, "posix")), args.steps)


def point_plan(shape: dict, points, timed: int) -> List[dict]:
    """(name, micro-batch, engine) -> the plan's points: their pools, and the steps each runs
    (keep: one more, the records' sizes; adaptive: until it settles)."""
    pts = []
    for name, mb, engine in points:
        settings = {}
        if engine == "memory":
            settings = dict(host_memory_bytes=memory_pool_bytes(activation_bytes(shape, mb)),
                            pinned_staging_bytes=OVERFLOW_STAGING)
        elif engine == "posix":
            settings = dict(max_inflight_bytes=MEASURE_INFLIGHT)
        steps = {"adaptive": ADAPTIVE_SETTLE_CAP, "keep": 2}.get(name, 1) + timed
        pinned = pinned_bytes(engine, settings) if engine else \
            (2 * save_on_cpu_bytes(shape, mb) if name == "save_on_cpu" else 0)  # torch's allocator, powers of two
        pts.append(dict(name=f"{name}@{mb}", micro_batch=mb, engine=engine, settings=settings, steps=steps,
                        pinned=pinned))
    return pts


def measure_shape(args) -> dict:
    return dict(layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
                micro_batch=args.micro_batch, num_microbatches=1)


def measure_estimate(args) -> dict:
    return points_estimate(measure_shape(args), measure_points(args))


def points_estimate(shape: dict, points: List[dict]) -> dict:
    """Seconds a measure step needs at the ASSUME rates: its start, then per point the
    registration of its pinned pools and its steps' compute and, for offload, the bytes both
    ways over the engine's link (memory: the host link; posix: the drive), and the bounds'
    rates: the link on registered memory (LINK_BYTES each way and both at once, a few times)
    and the drive with the posix point's bytes. Adaptive offloads about half of its
    activations in a step (what its budget cannot hold, and the all-offload plan it tries
    once); save_on_cpu copies every saved tensor, the weights included, both ways over the host
    link."""
    per_point: Dict[str, dict] = {}
    register = 0.0
    for p in points:
        mb, act = p["micro_batch"], activation_bytes(shape, p["micro_batch"])
        base = p["name"].split("@")[0]
        comp = _compute_s(shape, mb, recompute=base == "recompute")
        link = {"memory": ASSUME["link_bps"], "posix": ASSUME["drive_bps"]}.get(p["engine"])
        moved = 2 * act * (0.5 if base == "adaptive" else 1.0) if link else 0
        if base == "save_on_cpu":
            link, moved = ASSUME["link_bps"], 2 * save_on_cpu_bytes(shape, mb)
        reg = p["pinned"] / ASSUME["register_bps"]
        register += reg
        io = moved / link if link else 0.0
        per_point[p["name"]] = {"steps": p["steps"], "compute_s": comp, "io_s": io, "register_s": reg,
                                "seconds": round(reg + p["steps"] * (comp + io), 1)}
    rates = {"link": 0.0, "drive": 0.0}
    if any(p["engine"] == "memory" for p in points):
        link_bytes = min(LINK_BYTES, activation_bytes(shape))
        rates["link"] = 4 * link_bytes / ASSUME["register_bps"] + 12 * link_bytes / ASSUME["link_bps"]
    if any(p["engine"] == "posix" and p["name"].startswith("offload") for p in points):
        rates["drive"] = 2 * activation_bytes(shape) / ASSUME["drive_bps"]
        rates["drive_raw"] = 2 * min(activation_bytes(shape), RAW_MAX_BYTES) / ASSUME["drive_bps"]
    per_point["bounds' rates"] = {"seconds": round(sum(rates.values()), 1)}
    per_point["model build"] = {"seconds": round(8 * parameters(shape) / ASSUME["build_bps"], 1)}
    if shape.get("attention") == "sdpa":
        per_point["attention kernel"] = {"seconds": ASSUME["sdpa_first_s"]}
    total = ASSUME["start_s"] + sum(p["seconds"] for p in per_point.values())
    return {"seconds": round(total, 1), "points": per_point, "rates_s": {k: round(v, 1) for k, v in rates.items()},
            "register_s": round(register, 1), "activation_bytes_per_step": activation_bytes(shape),
            "assumptions": ASSUME}


def reserves(estimate: dict) -> Dict[str, float]:
    """Seconds each point (by name) and each rate ("link", "drive") of a points_estimate is
    expected to take: what the measure step keeps in hand before starting it
    (gpu_check_measure.Measure.reserve)."""
    out = {name: e["seconds"] for name, e in estimate["points"].items() if "@" in name}
    out.update(estimate["rates_s"])
    return out


def gpu_bytes(shape: dict, micro_batch: int) -> int:
    """GPU memory a measure step of ``shape`` needs at ``micro_batch``, keep's the largest: bf16
    weights, gradients and Adam's two moments (8 bytes a parameter), the activations, the
    logits and their fp32 loss (6 bytes a token of the vocabulary), and 2 GiB for the CUDA
    context, cuBLAS's workspace and the allocator's fragments."""
    logits = 6 * micro_batch * shape["seq"] * shape["vocab"]
    return 8 * parameters(shape) + activation_bytes(shape, micro_batch) + logits + 2 * GiB


def card_check(shapes: Dict[str, tuple]) -> Tuple[bool, List[str]]:
    """``shapes``: name -> (shape, the largest micro-batch it runs at, host bytes it pins at
    most). Whether each fits the GPU memory and host RAM of every card of CARDS, and a line
    per card saying so."""
    fits, lines = True, []
    for card, c in CARDS.items():
        parts = []
        for name, (shape, mb, host) in shapes.items():
            need = gpu_bytes(shape, mb)
            ok = need <= 0.9 * c["gpu_bytes"] and host <= 0.75 * c["host_bytes"]
            fits &= ok
            parts.append(f"{name} {need / GiB:.0f} of {c['gpu_bytes'] / GiB:.0f} GiB, {host / GiB:.0f} GiB pinned of "
                         f"{c['host_bytes'] / GiB:.0f}{'' if ok else ' (does NOT fit)'}")
        assumed = " (assumed)" if card == ASSUMED_CARD else ""
        lines.append(f"{card}{assumed}: " + "; ".join(parts))
    return fits, lines


def estimates(args) -> Dict[str, Dict[str, float]]:
    """step -> {start, register, collect, work, total} in seconds (see the module docstring)."""
    out: Dict[str, Dict[str, float]] = {
        "env": {"start": ASSUME["torch_start_s"]},
        "install": {"work": ASSUME["pip_s"]},
        "imports": {"start": ASSUME["start_s"] - 5},  # megatron-core and kvikio, no model
    }
    for engine in ("posix", "memory", "tiered", "gds", "gds-compat"):
        settings = bitwise_settings("gds" if engine.startswith("gds") else engine)
        pinned = pinned_bytes(engine, settings, direct=engine == "gds")
        out[f"bitwise-{engine}"] = _comparison(BITWISE_SHAPE, BITWISE_STEPS, BITWISE_DELAY_CYCLES, pinned)
    stress = dict(min_tensor_bytes=16 * 1024, max_inflight_bytes=STRESS_INFLIGHT)
    out["stress"] = _comparison(STRESS_SHAPE, STRESS_STEPS, STRESS_DELAY_CYCLES, pinned_bytes("posix", stress))
    out["cuda-tests"] = {"collect": ASSUME["collect_s"], "work": ASSUME["cuda_tests_s"]}
    syncs = dict(bitwise_settings("memory"))
    out["syncs"] = {"start": ASSUME["start_s"], "register": pinned_bytes("memory", syncs) / ASSUME["register_bps"],
                    "work": 2 * 5 * _compute_s(BITWISE_SHAPE, BITWISE_SHAPE["micro_batch"])}
    out["optimizer-offload"] = optimizer_estimate(ASSUME)
    m = measure_estimate(args)
    out["measure"] = {"start": ASSUME["start_s"], "register": m["register_s"],
                      "work": m["seconds"] - ASSUME["start_s"] - m["register_s"]}
    for e in out.values():
        e["total"] = round(sum(e.values()), 1)
    return out


def plan(args, steps=STEPS) -> List[dict]:
    """The steps to run, in order: all, or those of --only and the steps they need."""
    needs = {n: deps for n, _, deps, _ in steps}
    chosen = set(args.only.split(",")) if args.only else set(needs)
    todo = list(chosen)
    while todo:
        for dep in needs[todo.pop()]:
            if dep not in chosen:
                chosen.add(dep)
                todo.append(dep)
    return [{"step": n, "timeout_s": t, "needs": list(d), "what": w} for n, t, d, w in steps if n in chosen]


def print_plan(args, steps: List[dict], say) -> bool:
    """The time plan of gpu-check; True when it fits (see :func:`print_steps`)."""
    notes = []
    if any(s["step"] == "measure" for s in steps):
        m = measure_estimate(args)
        notes.append(f"measure: {m['activation_bytes_per_step'] / 1e9:.1f} GB of activations per step at micro-batch "
                     f"{args.micro_batch}; {args.steps} timed steps per point; at drive {ASSUME['drive_bps'] / 1e9:g} GB/s, "
                     f"link {ASSUME['link_bps'] / 1e9:g} GB/s, {ASSUME['flops'] / 1e12:g} TFLOP/s, registration "
                     f"{ASSUME['register_bps'] / 1e9:g} GB/s")
        pts = measure_points(args)
        cards = card_check({"measure": (measure_shape(args), args.micro_batch + 1, max(p["pinned"] for p in pts))})
        return print_steps(args, steps, say, estimates(args), PARENT_S, notes, cards)
    return print_steps(args, steps, say, estimates(args), PARENT_S, notes)


def print_steps(args, steps: List[dict], say, est: Dict[str, Dict[str, float]], parent_s: float,
                notes: List[str], cards: Optional[Tuple[bool, List[str]]] = None) -> bool:
    """Each step's limit and estimate (its parts), their sums, ``notes``, and ``cards``
    (card_check's verdict and lines); True when it fits: each step's estimate within its
    limit (a step in its own process: before its SIGTERM, KILL_GRACE_S earlier), the limits adding up to --total-s less the parent's share at most, and the shapes
    fitting every card."""
    total = sum(s["timeout_s"] for s in steps)
    fits = True
    for s in steps:
        e = est[s["step"]]
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in e.items() if k != "total" and v >= 0.05)
        over = e["total"] > s["timeout_s"] - (0 if s["step"] in PARENT_RUNS else KILL_GRACE_S)
        fits &= not over
        say(f"  {s['step']:<19} limit {s['timeout_s']:>4}s  estimate {e['total']:>5.0f}s"
            f"{' OVER' if over else ''}  ({parts})  {s['what']}")
    budget = args.total_s - parent_s
    fits &= total <= budget
    register = sum(est[s["step"]].get("register", 0) for s in steps)
    collect = sum(est[s["step"]].get("collect", 0) for s in steps)
    say(f"  {'sum':<19} limit {total:>4}s  of {budget:g}s ({args.total_s}s less {parent_s:g}s for the parent); "
        f"estimates {sum(est[s['step']]['total'] for s in steps):.0f}s, of which registering pinned "
        f"memory {register:.0f}s" + (f" and collecting tests {collect:.0f}s" if collect else ""))
    for line in notes:
        say(f"  {line}")
    if cards is not None:
        fits &= cards[0]
        say(f"  the same time plan on either card (ASSUME's rates are below both); memory on each, the largest "
            f"point's GPU memory and pinned host memory:")
        for line in cards[1]:
            say(f"    {line}")
    say("the plan fits" if fits else "the plan does NOT fit: shorten the steps or shrink --layers/--hidden/--seq")
    return fits
