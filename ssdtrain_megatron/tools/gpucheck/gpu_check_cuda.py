"""The cuda-tests step of `make gpu-check`: the suite's `cuda`-marked tests that can run on the
one-GPU box, every one of them required to pass.

Why a list: a pytest summary of "N passed" says nothing of what was skipped, and a required
test that skips (kvikio missing, a wrong torch) proves nothing. So the files that hold the
tests this box can run are named (REQUIRED_FILES) and every `cuda` test collected from them
must pass; the tests expected there are listed (REQUIRED_TESTS), and one that did not run is
a failure too. The `cuda` tests this box cannot run are named with the reason
(OPTIONAL_FILES): they need what the box lacks (Transformer Engine, DeepSpeed, two GPUs) and
are not collected at all, which keeps the step's collection to these few files (collecting
the whole suite took about 40 s of the step's time on a 2-core machine).
tests/test_gpu_check.py keeps the lists in step with the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from typing import Dict, List

from .gpu_check_common import deadline_left

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

REQUIRED_FILES = [
    "tests/test_cuda_graphs.py", "tests/test_cuda_streams.py", "tests/test_device_copy.py",
    "tests/test_engine_backends.py", "tests/test_engines.py", "tests/test_gds_setup.py",
    "tests/test_memory_tier_direct.py", "tests/test_pinned.py", "tests/test_staging_race.py",
]  # test_engines.py marks its gds cases cuda; none is in its engine lists today
OPTIONAL_FILES = {
    "tests/test_deepspeed_integration.py": "needs DeepSpeed, which the bundle does not carry (and 2 GPUs for the pipeline)",
    "tests/test_megatron_integration.py": "needs Transformer Engine, which the bundle does not carry, and 2 GPUs",
    "tests/test_megatron_moe.py": "needs Transformer Engine, DeepEP and 2 GPUs",
}
_ENGINES = ("posix", "memory", "tiered", "gds")
REQUIRED_TESTS = sorted(
    ["tests/test_cuda_graphs.py::test_cuda_a_real_capture_inside_a_micro_batch_keeps_its_tensors",
     "tests/test_cuda_streams.py::test_cuda_offload_and_reload_streams_are_not_in_torchs_stream_pool",
     "tests/test_engine_backends.py::test_memory_pool_is_pinned_where_cuda_exists",
     "tests/test_gds_setup.py::test_cuda_gds_reads_are_4k_aligned_and_bitwise[dense]",
     "tests/test_gds_setup.py::test_cuda_gds_reads_are_4k_aligned_and_bitwise[compact]",
     "tests/test_memory_tier_direct.py::test_cuda_the_memory_engine_copies_device_to_pool_directly_and_bitwise[False]",
     "tests/test_memory_tier_direct.py::test_cuda_the_memory_engine_copies_device_to_pool_directly_and_bitwise[True]",
     "tests/test_pinned.py::test_cuda_exactly_pinned_memory_is_pinned_and_copies_asynchronously"]
    + [f"tests/test_device_copy.py::test_cuda_every_offloaded_tensor_is_ordered_and_bitwise[{s}-{v}-{e}]"
       for s in ("default", "compute") for v in ("span", "compact") for e in _ENGINES]
    + [f"tests/test_staging_race.py::{t}[cuda]" for t in (
        "test_a_cancelled_write_returns_its_staging_only_after_its_copy",
        "test_a_write_backward_takes_back_returns_its_staging_only_after_its_copy",
        "test_a_write_refused_by_a_full_host_pool_returns_its_staging_only_after_its_copy",
        "test_a_write_the_engine_raised_on_returns_its_staging_only_after_its_copy")])


def node_id(case: ET.Element) -> str:
    """A junit testcase's pytest node id: classname ``tests.test_x`` (or ``tests.test_x.Class``)
    and name -> ``tests/test_x.py::[Class::]name``."""
    parts = case.get("classname", "").split(".")
    mod = [p for p in parts if not p[:1].isupper()]
    cls = [p for p in parts if p[:1].isupper()]
    return "/".join(mod) + ".py::" + "::".join(cls + [case.get("name", "")])


def outcomes(junit_path: str) -> Dict[str, dict]:
    """node id -> {"outcome": passed | failed | error | skipped, "message": ...}."""
    out: Dict[str, dict] = {}
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            el = case.find(kind)
            if el is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                text = (el.get("message") or el.text or "").strip()
                message = text.splitlines()[0][:300] if text else ""
                break
        out[node_id(case)] = {"outcome": outcome, "message": message}
    return out


def judge(results: Dict[str, dict], rc: int, tail: List[str]) -> dict:
    """pass only when every required test, and every other collected one, passed."""
    missing = [t for t in REQUIRED_TESTS if t not in results]
    bad = {t: r for t, r in results.items() if r["outcome"] != "passed"}
    out = {"ran": len(results), "required": len(REQUIRED_TESTS), "passed": len(results) - len(bad),
           "not_passed": bad, "missing": missing, "rc": rc, "tail": tail,
           "optional_not_run": OPTIONAL_FILES}
    if not results:
        return dict(out, status="fail", why=f"no cuda test ran (pytest exit status {rc}): {' | '.join(tail[-3:])}")
    if bad:
        first = next(iter(bad.items()))
        return dict(out, status="fail", why=f"{len(bad)} of {len(results)} cuda tests did not pass; first: "
                                            f"{first[0]} {first[1]['outcome']}: {first[1]['message']}")
    if missing:
        return dict(out, status="fail", why=f"{len(missing)} required cuda tests did not run; first: {missing[0]}")
    return dict(out, status="pass", summary=f"{len(results)} cuda tests passed, {len(REQUIRED_TESTS)} of them "
                                            f"required; not run here: {', '.join(os.path.basename(f) for f in OPTIONAL_FILES)}")


def step_cuda_tests(args, save) -> dict:
    os.makedirs(os.path.join(args.out, "logs"), exist_ok=True)
    junit = os.path.join(args.out, "logs", "cuda-tests.xml")
    if os.path.exists(junit):
        os.unlink(junit)
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "-rs",
           f"--junitxml={junit}"] + REQUIRED_FILES
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(10, min(deadline_left() - 3, 3600)))
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc, text = -1, f"{exc.stdout or ''}{exc.stderr or ''}\npytest ran over its time"
    tail = (text if isinstance(text, str) else text.decode(errors="replace")).strip().splitlines()[-15:]
    results = outcomes(junit) if os.path.exists(junit) else {}
    out = judge(results, rc, tail)
    if rc == -1:
        out.update(status="timeout", why=f"pytest ran over its time after {len(results)} tests")
    return out
