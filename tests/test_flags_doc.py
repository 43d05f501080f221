"""docs/flags.md documents every ``--ssd-offload-*`` flag the Megatron argument group has
(issue 58: the plan told users to set --ssd-offload-pinned-staging-bytes, which the doc did
not name). The parser is the real one; the doc is read as a user reads it."""

from __future__ import annotations

import argparse
import os
import re

from ssdtrain_megatron.megatron.args import add_ssd_offload_args

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _documented(doc: str, flag: str) -> bool:
    """The flag in backticks, alone or followed by its value or a `/ --no-...` form."""
    return re.search(r"`" + re.escape(flag) + r"(`| [A-Z{\[])", doc) is not None


def test_every_ssd_offload_flag_of_the_parser_is_in_docs_flags_md():
    """Broken variant (the pinned-staging row taken out of docs/flags.md): the list names
    --ssd-offload-pinned-staging-bytes."""
    parser = argparse.ArgumentParser()
    add_ssd_offload_args(parser)
    flags = [option for action in parser._actions  # noqa: SLF001
             for option in action.option_strings
             if option.startswith("--ssd-offload") and action.help != argparse.SUPPRESS
             and not option.startswith("--no-")]
    assert "--ssd-offload-pinned-staging-bytes" in flags and len(flags) > 30
    with open(os.path.join(REPO, "docs", "flags.md"), encoding="utf-8") as fh:
        doc = fh.read()
    missing = [flag for flag in flags if not _documented(doc, flag)]
    assert missing == []


def test_one_host_memory_rule_in_the_code_the_doctor_and_the_docs():
    """Three quarters of what is free, shared by the node's GPUs: the job's rule
    (USABLE_FRACTION), the doctor's measured profile and both docs. Broken variants: the doctor
    dividing MemAvailable alone (host_memory_per_gpu without the fraction) -> 200 GB per GPU;
    docs/models.md back on "60% of the GPU's share"."""
    from ssdtrain_megatron.plan.engine_choice import USABLE_FRACTION, free_per_rank
    from ssdtrain_megatron.plan.node import load_profile
    from ssdtrain_megatron.tools.node_profile import host_memory_per_gpu

    free = 1600 * 10 ** 9
    assert USABLE_FRACTION == 0.75
    assert host_memory_per_gpu(free, 8) == free_per_rank(free, 8, 0) == 150 * 10 ** 9
    assert load_profile("dgx-h100").host_memory_bytes == host_memory_per_gpu(free, 8)
    docs = {}
    for name in ("models.md", "flags.md"):
        with open(os.path.join(REPO, "docs", name), encoding="utf-8") as fh:
            docs[name] = " ".join(fh.read().split())
    assert "60%" not in docs["models.md"]
    assert "three quarters of the memory free at the job's start" in docs["models.md"]
    assert "1.6 TB x 3/4 / 8 = 150 GB" in docs["models.md"]
    assert "Three quarters of it" in docs["flags.md"]


def test_the_dgx_raid_layout_is_documented_with_a_template_the_config_takes():
    """docs/cluster.md's /raid section: how to tell the layouts apart, and a --ssd-offload-dir
    the flags accept (a {job} in it, one directory per local rank)."""
    from ssdtrain_megatron.megatron.args import config_from_args

    with open(os.path.join(REPO, "docs", "cluster.md"), encoding="utf-8") as fh:
        doc = fh.read()
    section = doc[doc.index("## A DGX as it ships: one RAID-0 at `/raid`"):]
    for said in ("findmnt -no SOURCE,FSTYPE /raid", "cat /proc/mdstat", "lsblk"):
        assert said in section, said
    template = re.search(r"--ssd-offload-dir '([^']+)'", section).group(1)
    assert template == "/raid/{user}/ssdtrain/{local_rank}/{job}"  # a folder per user (issue 65)
    parser = argparse.ArgumentParser()
    add_ssd_offload_args(parser)
    config = config_from_args(parser.parse_args(["--ssd-offload", "--ssd-offload-dir", template]))
    assert list(config.dirs) == [template]
