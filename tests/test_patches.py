"""patches/: small, well-formed, importing only what the package has; scripts/apply_patches.sh
picks the one that fits, applies it, and says clearly when none does. With MEGATRON_LM_DIR /
MEGATRON_DEEPSPEED_DIR set, the patches are checked (`git apply --check`) against those
checkouts; without them those tests skip with that reason."""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES = os.path.join(REPO, "patches")
APPLY = os.path.join(REPO, "scripts", "apply_patches.sh")
LM_PATCHES = ["megatron-lm-core_v0.16.patch", "megatron-lm-core_v0.18.patch",
              "megatron-lm-main.patch"]
# megatron-core minor version of a Megatron-LM checkout -> the patch for its pretrain_gpt.py
# (tags core_v0.16.1, core_v0.17.1, core_v0.18.2, core_v0.19.0; anything newer: main's).
LM_PATCH_FOR = {"0.16": "megatron-lm-core_v0.16.patch", "0.17": "megatron-lm-core_v0.16.patch",
                "0.18": "megatron-lm-core_v0.18.patch", "0.19": "megatron-lm-main.patch",
                "0.20": "megatron-lm-main.patch"}
DS_PATCH = "megatron-deepspeed.patch"
ALL_PATCHES = LM_PATCHES + [DS_PATCH]

MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
MEGATRON_DEEPSPEED_DIR = os.environ.get("MEGATRON_DEEPSPEED_DIR")


def _read(name: str) -> str:
    with open(os.path.join(PATCHES, name), encoding="utf-8") as fh:
        return fh.read()


def _git_apply(args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "apply", *args], cwd=cwd, capture_output=True, text=True)


def test_patches_folder_holds_the_four_patches_and_the_script_knows_them():
    shipped = sorted(f for f in os.listdir(PATCHES) if f.endswith(".patch"))
    assert shipped == sorted(ALL_PATCHES)
    with open(APPLY, encoding="utf-8") as fh:
        listed = re.search(r"^patches=\(([^)]*)\)", fh.read(), re.M).group(1).split()
    assert listed == ALL_PATCHES  # most specific first


@pytest.mark.parametrize("name", ALL_PATCHES)
def test_patch_is_a_handful_of_lines_in_pretrain_gpt(name, tmp_path):
    numstat = _git_apply(["--numstat", os.path.join(PATCHES, name)], str(tmp_path))
    assert numstat.returncode == 0, numstat.stderr
    added, removed, path = numstat.stdout.split()
    assert path == "pretrain_gpt.py"
    assert int(added) <= 8 and int(removed) <= 2, (added, removed)


@pytest.mark.parametrize("name", ALL_PATCHES)
def test_patch_imports_only_what_the_package_has(name):
    imports = re.findall(r"^\+\s*from (ssdtrain_megatron[\w.]*) import (\w+)", _read(name), re.M)
    assert imports, "a patch imports its hook from ssdtrain_megatron"
    for module, attr in imports:
        assert hasattr(importlib.import_module(module), attr), (module, attr)


def test_deepspeed_patch_installs_through_the_deepspeed_target():
    from ssdtrain_megatron.megatron.launch import TARGETS

    assert 'with_ssd_offload(pretrain, target="megatron-deepspeed")' in _read(DS_PATCH)
    assert TARGETS["megatron-deepspeed"].installer == "ssdtrain_megatron.megatron.deepspeed"


# -- apply_patches.sh on stand-in checkouts --------------------------------------------------


def _stand_in_patches(tmp_path):
    """Patches shaped like the real ones, against versions of a toy script."""
    versions = {"megatron-lm-core_v0.16.patch": "release", "megatron-lm-core_v0.18.patch":
                "release-0.18", "megatron-lm-main.patch": "main", DS_PATCH: "deepspeed"}
    folder = tmp_path / "patches"
    folder.mkdir()
    for name, version in versions.items():
        a, b = tmp_path / "a", tmp_path / "b"
        for d, extra in ((a, ""), (b, "install()  # ssdtrain-megatron\n")):
            d.mkdir(exist_ok=True)
            (d / "pretrain_gpt.py").write_text(f"# {version}\nimport os\n{extra}pretrain()\n")
        diff = subprocess.run(["git", "diff", "--no-index", "--no-prefix", "a/pretrain_gpt.py",
                               "b/pretrain_gpt.py"], cwd=tmp_path, capture_output=True, text=True)
        (folder / name).write_text(f"header for {name}\n\n" + diff.stdout)
    return folder


def _checkout(tmp_path, version: str):
    d = tmp_path / f"checkout-{version}"
    d.mkdir()
    (d / "pretrain_gpt.py").write_text(f"# {version}\nimport os\npretrain()\n")
    return d


def _apply(args, patches_dir):
    env = dict(os.environ, SSDTRAIN_PATCHES_DIR=str(patches_dir))
    return subprocess.run(["bash", APPLY, *args], capture_output=True, text=True, env=env)


def test_apply_patches_applies_the_patch_that_fits(tmp_path):
    patches = _stand_in_patches(tmp_path)
    checkout = _checkout(tmp_path, "main")
    out = _apply([str(checkout)], patches)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == (f"apply_patches: applied megatron-lm-main.patch to "
                                          f"{checkout}/pretrain_gpt.py")
    assert "install()" in (checkout / "pretrain_gpt.py").read_text()
    again = _apply([str(checkout)], patches)
    assert again.returncode == 0
    assert again.stdout.strip() == (f"apply_patches: megatron-lm-main.patch is already applied "
                                    f"to {checkout}/pretrain_gpt.py")


def test_apply_patches_check_changes_nothing(tmp_path):
    patches = _stand_in_patches(tmp_path)
    checkout = _checkout(tmp_path, "deepspeed")
    before = (checkout / "pretrain_gpt.py").read_text()
    out = _apply(["--check", str(checkout)], patches)
    assert out.returncode == 0
    assert out.stdout.strip() == (f"apply_patches: {DS_PATCH} fits {checkout}/pretrain_gpt.py "
                                  "(--check: nothing changed)")
    assert (checkout / "pretrain_gpt.py").read_text() == before


def test_apply_patches_says_clearly_when_none_fits(tmp_path):
    patches = _stand_in_patches(tmp_path)
    checkout = _checkout(tmp_path, "someone-elses-fork")
    out = _apply([str(checkout)], patches)
    assert out.returncode == 1
    err = out.stderr.splitlines()
    assert err[0] == f"apply_patches: no patch fits {checkout}/pretrain_gpt.py; tried:"
    for i, name in enumerate(ALL_PATCHES):
        assert err[1 + i].startswith(f"  {name}: error: patch failed: pretrain_gpt.py")
    assert "-m ssdtrain_megatron.launch" in out.stderr
    assert (checkout / "pretrain_gpt.py").read_text().startswith("# someone-elses-fork")


def test_apply_patches_rejects_a_folder_without_pretrain_gpt(tmp_path):
    out = _apply([str(tmp_path)], PATCHES)
    assert out.returncode == 2
    assert out.stderr.startswith(f"apply_patches: {tmp_path}/pretrain_gpt.py not found")
    assert _apply([], PATCHES).returncode == 2


def test_apply_patches_works_in_a_subfolder_of_a_git_repository(tmp_path):
    patches = _stand_in_patches(tmp_path)
    repo = tmp_path / "monorepo"
    (repo / "third_party").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    checkout = repo / "third_party" / "megatron"
    shutil.move(str(_checkout(tmp_path, "release")), str(checkout))
    out = _apply([str(checkout)], patches)
    assert out.returncode == 0, out.stderr
    assert "applied megatron-lm-core_v0.16.patch" in out.stdout
    assert "install()" in (checkout / "pretrain_gpt.py").read_text()


# -- against real checkouts ------------------------------------------------------------------


def _megatron_core_version(checkout: str) -> str:
    fields = {}
    with open(os.path.join(checkout, "megatron", "core", "package_info.py"), encoding="utf-8") as fh:
        for line in fh:
            m = re.match(r"(MAJOR|MINOR)\s*=\s*(\d+)", line)
            if m:
                fields[m.group(1)] = m.group(2)
    return f"{fields.get('MAJOR')}.{fields.get('MINOR')}"


@pytest.mark.skipif(not MEGATRON_LM_DIR,
                    reason="MEGATRON_LM_DIR is not set: it names a Megatron-LM checkout to check "
                           "the Megatron-LM patches against")
def test_megatron_lm_patch_for_the_checkouts_version_applies():
    expected = LM_PATCH_FOR.get(_megatron_core_version(MEGATRON_LM_DIR), "megatron-lm-main.patch")
    check = _git_apply(["--check", os.path.join(PATCHES, expected)], MEGATRON_LM_DIR)
    assert check.returncode == 0, check.stderr
    out = _apply(["--check", MEGATRON_LM_DIR], PATCHES)
    assert out.returncode == 0, out.stderr
    assert f"{expected} fits" in out.stdout


@pytest.mark.skipif(not MEGATRON_DEEPSPEED_DIR,
                    reason="MEGATRON_DEEPSPEED_DIR is not set: it names a Megatron-DeepSpeed "
                           "checkout to check the Megatron-DeepSpeed patch against")
def test_megatron_deepspeed_patch_applies():
    check = _git_apply(["--check", os.path.join(PATCHES, DS_PATCH)], MEGATRON_DEEPSPEED_DIR)
    assert check.returncode == 0, check.stderr
    out = _apply(["--check", MEGATRON_DEEPSPEED_DIR], PATCHES)
    assert out.returncode == 0, out.stderr
    assert f"{DS_PATCH} fits" in out.stdout
