"""Measure a root job's start-up sweep with N rank directories planted by another user in one
folder (issue 65, symptom 4): ``python tests/sweep_flood.py 20000 unknown`` (records of another
boot: judged "cannot tell" and left) or ``... dead`` (this boot, unlocked: removed). Needs root
(useradd); not a test (nothing here is collected by pytest)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time

from ssdtrain_megatron.io.clean import sweep_before_start
from ssdtrain_megatron.io.layout import rank_dir_name
from ssdtrain_megatron.io.owner import boot_id


def main(n: int, kind: str) -> None:
    top = tempfile.mkdtemp(prefix="ssdt-flood-", dir="/tmp")
    root = os.path.join(top, "R")
    os.mkdir(root)
    os.chmod(root, 0o1777)
    name = f"ssdfl{os.getpid() % 100000}"
    subprocess.run(["useradd", "-M", "-r", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        uid = pwd.getpwnam(name).pw_uid
        folder = os.path.join(root, "evil")
        os.mkdir(folder, 0o700)
        os.chown(folder, uid, uid)
        boot = boot_id() if kind == "dead" else "another boot"
        for i in range(n):
            d = os.path.join(folder, rank_dir_name("evil", "h", 0, 1000 + i))
            os.mkdir(d, 0o700)
            with open(os.path.join(d, "owner.json"), "w") as fh:
                json.dump({"pid": 1000 + i, "hostname": "h", "job": "evil", "rank": 0, "boot_id": boot,
                           "lock": "flock"}, fh)
            os.chown(os.path.join(d, "owner.json"), uid, uid)
            os.chown(d, uid, uid)
        os.sync()
        t = time.perf_counter()
        found = sweep_before_start([], [os.path.join(root, "{job}")], "h")
        took = time.perf_counter() - t
        print(f"{kind}: {n} fake rank dirs: start-up sweep {took:.2f} s, {len(found)} judged, "
              f"{sum(f.removed for f in found)} removed")
    finally:
        shutil.rmtree(top)
        subprocess.run(["userdel", name], capture_output=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
