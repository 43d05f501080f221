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
