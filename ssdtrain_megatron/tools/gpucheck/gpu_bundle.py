#!/usr/bin/env python3
"""`make gpu-bundle`: the wheels `make gpu-check` needs on the bare GPU box, and proof they suffice.

The box (see docs/gpu-check.md) has Python 3.12, torch 2.11 built for
CUDA 13 with everything torch itself requires, and cupy-cuda13x; it has no network. This script,
run on a machine with network (any Python with pip >= 22.2; no GPU):

1. resolves, online and without downloading wheels (``pip install --dry-run --report``), the full
   set for cp312 / manylinux x86_64 of ``REQUIREMENTS`` together with ``torch==2.11.0``, and the
   set of torch alone;
2. downloads into ``.whl/`` every wheel of the first set that is neither in torch's set nor in
   ``BOX_ALSO``, one version each, and removes any other wheel there (two versions of one
   package would make the install on the box ambiguous);
3. proves offline that the folder is complete: with stand-in wheels (empty, with the real
   wheels' extras and dependencies) for torch's set and ``BOX_ALSO`` -- what the box has
   installed -- pip resolves
   ``REQUIREMENTS`` with ``--no-index --find-links .whl`` and no configuration (``--isolated``),
   and every package it picks is either a stand-in or a wheel of the folder, and every wheel of
   the folder is used;
4. checks that the folder stays under ``--max-mib`` (60 MiB: the whole tree that travels to the
   box is limited to 64 MiB).

Exit status 0 only when all four hold; 1 with the reason otherwise.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from typing import Dict, List, Optional, Sequence

log = logging.getLogger("gpu_bundle")

# What gpu-check imports on the box, beyond torch: megatron-core for the GPT it trains, kvikio for
# the gds engine, pytest for the cuda tests, and this project's own install_requires (setup.py;
# tests/test_gpu_check.py keeps the two in step).
REQUIREMENTS = ["megatron-core==0.16.1", "kvikio-cu13==26.10.*", "libkvikio-cu13==26.10.*", "pytest",
                "pyyaml>=6", "numpy", "tqdm>=4.60", "crc32c>=2.3"]
BOX_TORCH = "torch==2.11.0"
# On the box besides torch's own set (the device README lists it); about 100 MB, so never carried.
BOX_ALSO = ["cupy-cuda13x"]
MAX_MIB = 60
PLATFORMS = ["manylinux1_x86_64", "manylinux2010_x86_64", "manylinux2014_x86_64"] + [
    f"manylinux_2_{n}_x86_64" for n in range(5, 40)]  # the box: glibc 2.39 (Ubuntu 24.04)
TARGET = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312"] + [
    a for p in PLATFORMS for a in ("--platform", p)]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip(args: Sequence[str], **kw) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip"] + list(args)
    log.debug("%s", " ".join(cmd))
    return subprocess.run(cmd, text=True, capture_output=True, **kw)


def resolve(requirements: Sequence[str], work: str, offline_links: Optional[List[str]] = None) -> Dict[str, dict]:
    """{canonical name: {"version", "url", "provides_extra"}} that pip picks for ``requirements``
    on the box's platform, without installing (or, online, downloading) anything."""
    os.makedirs(work, exist_ok=True)
    report = os.path.join(work, "report.json")
    args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", report,
            "--target", os.path.join(work, "target")] + TARGET
    if offline_links is not None:
        args = ["--isolated"] + args + ["--no-index"] + [a for d in offline_links for a in ("--find-links", d)]
    proc = pip(args + list(requirements))
    if proc.returncode != 0:
        where = "offline from the bundle" if offline_links is not None else "online"
        raise RuntimeError(f"pip could not resolve {' '.join(requirements)} {where}:\n{proc.stderr.strip()[-3000:]}")
    with open(report) as f:
        data = json.load(f)
    return {canonical(i["metadata"]["name"]): {"version": i["metadata"]["version"],
                                               "url": i["download_info"]["url"],
                                               "provides_extra": i["metadata"].get("provides_extra", []),
                                               "requires_dist": i["metadata"].get("requires_dist", [])}
            for i in data["install"]}


def stand_in(folder: str, name: str, version: str, extras: Sequence[str], requires: Sequence[str] = ()) -> str:
    """An empty py3-none-any wheel with the real one's extras and dependencies: to the resolver,
    "installed on the box" (torch's own dependencies must then be met by the box too)."""
    dist = f"{canonical(name).replace('-', '_')}-{version}"
    path = os.path.join(folder, f"{dist}-py3-none-any.whl")
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"] + [f"Provides-Extra: {e}" for e in extras] + [
        f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n")
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: gpu_bundle\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


def wheel_name(filename: str) -> str:
    return canonical(filename.split("-", 1)[0])


def download(pins: Dict[str, str], dest: str) -> None:
    os.makedirs(dest, exist_ok=True)
    for f in sorted(os.listdir(dest)):
        if f.endswith(".whl") and pins.get(wheel_name(f)) is None:
            log.info("removing %s: not part of the bundle", f)
            os.unlink(os.path.join(dest, f))
    have = {wheel_name(f): f for f in os.listdir(dest) if f.endswith(".whl")}
    for name, version in sorted(pins.items()):
        f = have.get(name)
        if f and f.split("-")[1] == version:
            continue
        if f:
            log.info("removing %s: the bundle pins %s %s", f, name, version)
            os.unlink(os.path.join(dest, f))
        proc = pip(["download", "--no-deps", "--quiet", "-d", dest] + TARGET + [f"{name}=={version}"])
        if proc.returncode != 0:
            raise RuntimeError(f"pip download {name}=={version} failed:\n{proc.stderr.strip()[-2000:]}")
        log.info("downloaded %s %s", name, version)


def prove_offline(dest: str, box: Dict[str, dict], work: str) -> List[str]:
    """Resolve REQUIREMENTS with nothing but the bundle and stand-ins for the box; the lines of
    what was picked, or RuntimeError naming what is missing or unused."""
    stubs = os.path.join(work, "box")
    os.makedirs(stubs)
    for name, info in box.items():
        stand_in(stubs, name, info["version"], info["provides_extra"], info.get("requires_dist", []))
    box_pins = [f"{n}=={box[n]['version']}" for n in ("torch",) + tuple(canonical(b) for b in BOX_ALSO)]
    picked = resolve(box_pins + REQUIREMENTS, os.path.join(work, "offline"), offline_links=[dest, stubs])
    files = {f for f in os.listdir(dest) if f.endswith(".whl")}
    lines, used, problems = [], set(), []
    for name, info in sorted(picked.items()):
        f = os.path.basename(info["url"])
        if name in box:
            lines.append(f"  {name:<24} {info['version']:<12} on the box")
        elif f in files:
            used.add(f)
            lines.append(f"  {name:<24} {info['version']:<12} {f}")
        else:
            problems.append(f"{name} {info['version']} came from neither the bundle nor the box: {info['url']}")
    problems += [f"{f} is in {dest} but nothing needs it" for f in sorted(files - used)]
    if problems:
        raise RuntimeError("the offline resolve does not match the bundle: " + "; ".join(problems))
    return lines


def size_mib(dest: str) -> float:
    return sum(os.path.getsize(os.path.join(dest, f)) for f in os.listdir(dest) if f.endswith(".whl")) / 2**20


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_bundle", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dest", default=".whl", help="folder of the wheels (default: %(default)s)")
    p.add_argument("--max-mib", type=float, default=MAX_MIB, help="size limit of the folder (default: %(default)s)")
    p.add_argument("--offline-only", action="store_true",
                   help="no network: only prove that --dest is complete and small enough (needs the box.json "
                        "an earlier run left there)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="gpu-bundle: %(message)s")
    dest = os.path.abspath(args.dest)
    box_json = os.path.join(dest, "box.json")
    work = tempfile.mkdtemp(prefix="gpu-bundle-")
    try:
        if args.offline_only:
            with open(box_json) as f:
                box = json.load(f)
        else:
            everything = resolve([BOX_TORCH] + REQUIREMENTS, os.path.join(work, "all"))
            box = resolve([BOX_TORCH], os.path.join(work, "torch"))
            box.update({canonical(b): everything[canonical(b)] for b in BOX_ALSO if canonical(b) in everything})
            pins = {n: i["version"] for n, i in everything.items() if n not in box}
            log.info("on the box (not carried): %s", ", ".join(f"{n} {box[n]['version']}" for n in sorted(box)))
            download(pins, dest)
            with open(box_json, "w") as f:
                json.dump(box, f, indent=1, sort_keys=True)
        lines = prove_offline(dest, box, work)
    except (RuntimeError, OSError, ValueError) as exc:
        log.error("%s", exc)
        return 1
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("gpu-bundle: offline resolve (--no-index, the bundle plus stand-ins for what the box has):")
    print("\n".join(lines))
    mib = size_mib(dest)
    n = sum(f.endswith(".whl") for f in os.listdir(dest))
    print(f"gpu-bundle: {n} wheels, {mib:.1f} MiB in {dest} (limit {args.max_mib:g} MiB)")
    if mib >= args.max_mib:
        log.error("the bundle is %.1f MiB, over the %g MiB limit", mib, args.max_mib)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
