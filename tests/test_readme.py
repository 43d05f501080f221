"""The Python API example of docs/api.md (linked from the README), run as written (only its
drive paths changed): it must save memory, and it must offload for real (bytes written and
read back)."""

import os
import re

from tests.drives import mount

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _example() -> str:
    with open(os.path.join(ROOT, "docs", "api.md"), encoding="utf-8") as fh:
        text = fh.read()
    section = text  # its first python block
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def _run(code: str, tmp_path, policy: str):
    dirs = mount(tmp_path / "nvme0" / "{job}", tmp_path / "nvme1" / "{job}")  # the drives
    code = code.replace('dirs=["/mnt/nvme0/ssdtrain/{job}", "/mnt/nvme1/ssdtrain/{job}"]',
                        f"dirs={dirs!r}, policy={policy!r}")
    assert f"policy={policy!r}" in code, "the docs/api.md example's OffloadConfig line changed"
    scope: dict = {}
    exec(compile(code, "docs/api.md", "exec"), scope)  # noqa: S102 - our own docs
    return scope["stats"]


def test_the_python_api_example_saves_memory_as_written(tmp_path, capsys):
    keep = _run(_example(), tmp_path, "keep")
    offload = _run(_example(), tmp_path, "offload")
    assert offload.bytes_offloaded > 0 and offload.bytes_read > 0
    assert offload.peak_resident_bytes < 0.5 * keep.peak_resident_bytes, (offload, keep)
    assert "offloaded" in capsys.readouterr().out  # it prints the summary


def test_without_layer_scopes_the_example_would_save_nothing(tmp_path):
    """Why docs/api.md insists on off.layer(i): the whole micro-batch is then its last layer."""
    code = _example().replace("                with off.layer(i):             # one scope per layer: see below\n"
                              "                    x = layer(x)",
                              "                x = layer(x)")
    assert "off.layer" not in code
    keep = _run(code, tmp_path, "keep")
    offload = _run(code, tmp_path, "offload")
    assert offload.peak_resident_bytes == keep.peak_resident_bytes
