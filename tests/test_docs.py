"""The README and docs/ say only what exists: every relative link resolves (file and heading),
every command in a shell block or an inline ``ssdtrain ...`` span names a real subcommand and
real flags (read from the argparse parsers themselves), every ``make X`` is a Makefile target,
every ``--ssd-offload-*`` flag is one the Megatron flag group has, and every ``scripts/`` or
``configs/`` path exists. The README's plan table is exactly ``scripts/plan_table.py``'s output.

How each check was seen to fail (recorded in the report of issue 27): a link to
``docs/nope.md``, ``ssdtrain core-bench --manual-gc``, ``make nosuchtarget`` and an edited
table cell each made its test fail, naming the file and the line.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import sys
from typing import Dict, Iterator, List, Set, Tuple

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = ["README.md", os.path.join("configs", "README.md"), os.path.join("scripts", "README.md")] \
    + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
SHELL_FENCES = ("```bash", "```sh", "```shell", "```console", "```")


def _read(rel: str) -> str:
    with open(os.path.join(REPO, rel), encoding="utf-8") as fh:
        return fh.read()


def _prose_lines(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    fence = False
    for n, line in enumerate(text.splitlines(), start=1):
        if line.startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield n, line


def _shell_blocks(text: str) -> Iterator[Tuple[int, str]]:
    """(line number, command) from fenced blocks tagged bash/sh/shell or untagged (every line a
    command) and console (the lines after a ``$`` prompt), backslash continuations joined."""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        tag = lines[i].strip()
        if tag.startswith("```") and tag in SHELL_FENCES:
            i += 1
            pending, start = "", 0
            while i < len(lines) and not lines[i].startswith("```"):
                line = lines[i]
                if not pending:
                    start = i + 1
                if tag == "```console" and not (pending or line.startswith("$ ")):
                    i += 1  # a command's output
                    continue
                if line.rstrip().endswith("\\"):
                    pending += line.rstrip()[:-1] + " "
                else:
                    yield start, pending + line
                    pending = ""
                i += 1
        elif tag.startswith("```"):  # another language: skip to its end
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                i += 1
        i += 1


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(rel: str) -> Set[str]:
    seen: Dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(_read(rel)):
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(rel: str) -> List[str]:
    problems = []
    for n, line in _prose_lines(_read(rel)):
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(rel), path)) if path else rel
            if not os.path.exists(os.path.join(REPO, dest)):
                problems.append(f"{rel}:{n}: {target}: no file {dest}")
            elif anchor and dest.endswith(".md") and anchor not in _anchors(dest):
                problems.append(f"{rel}:{n}: {target}: no heading #{anchor} in {dest}")
    return problems


@pytest.mark.parametrize("rel", DOCS)
def test_every_relative_link_resolves(rel):
    assert broken_links(rel) == []


# -- commands ---------------------------------------------------------------------------------


def _ssdtrain_flags() -> Dict[str, Set[str]]:
    from ssdtrain_megatron.tools.cli import build_parser

    parser = build_parser()
    subs = parser._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse's own table
    top = {o for a in parser._actions for o in a.option_strings}  # noqa: SLF001
    return {name: top | {o for a in p._actions for o in a.option_strings}  # noqa: SLF001
            for name, p in subs.items()}


def _megatron_flags() -> Set[str]:
    from ssdtrain_megatron.megatron.args import add_ssd_offload_args

    parser = argparse.ArgumentParser()
    add_ssd_offload_args(parser)
    return {o for a in parser._actions for o in a.option_strings}  # noqa: SLF001


def _make_targets() -> Tuple[Set[str], List[str]]:
    targets, patterns = set(), []
    for line in _read("Makefile").splitlines():
        m = re.match(r"([A-Za-z0-9_.%-]+)\s*:(?!=)", line)
        if m:
            (patterns.append(m.group(1)) if "%" in m.group(1) else targets.add(m.group(1)))
    return targets, patterns


def command_problems(command: str, where: str, subs: Dict[str, Set[str]], megatron: Set[str],
                     make: Tuple[Set[str], List[str]]) -> List[str]:
    """What in one shell command names nothing real."""
    command = command.split(" #")[0].strip()
    if command.startswith("#") or not command:
        return []
    command = command.lstrip("$ ")
    problems = []
    for flag in re.findall(r"(?<![\w-])--ssd-offload[a-z0-9-]*", command):
        if flag not in megatron:
            problems.append(f"{where}: {flag} is not a --ssd-offload flag")
    for m in re.finditer(r"(?:^|[\s;&|(`])ssdtrain\s+([a-z][a-z-]*)([^;&|>`]*)", command):
        sub, rest = m.group(1), m.group(2)
        if sub not in subs:
            problems.append(f"{where}: ssdtrain {sub}: no such subcommand")
            continue
        # after a lone --: the job's launcher arguments (plan, doctor --preflight), checked as
        # --ssd-offload flags above
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", re.split(r"\s--(?:\s|$)", rest)[0]):
            if flag not in subs[sub]:
                problems.append(f"{where}: ssdtrain {sub} has no {flag}")
    for m in re.finditer(r"(?:^|[\s;&|(`])make\s+([A-Za-z0-9_.-]+)", command):
        target = m.group(1)
        targets, patterns = make
        if target not in targets and not any(
                re.fullmatch(p.replace(".", r"\.").replace("%", ".+"), target) for p in patterns):
            problems.append(f"{where}: make {target}: no such Makefile target")
    for path in re.findall(r"(?<![\w/.])((?:scripts|configs|patches)/[\w./-]+)", command):
        if not os.path.exists(os.path.join(REPO, path.rstrip("."))):
            problems.append(f"{where}: {path} does not exist")
    for module in re.findall(r"-m\s+(ssdtrain_megatron[\w.]*)", command):
        if importlib.util.find_spec(module) is None:
            problems.append(f"{where}: python -m {module}: no such module")
    return problems


def _commands(rel: str) -> Iterator[Tuple[str, str]]:
    text = _read(rel)
    for n, command in _shell_blocks(text):
        yield f"{rel}:{n}", command
    for n, line in _prose_lines(text):  # inline spans: `ssdtrain plan --config ...`, `make test`
        for span in re.findall(r"`([^`]+)`", line.replace("\\|", "|")):
            if re.match(r"(ssdtrain|make) ", span):
                yield f"{rel}:{n}", span


@pytest.fixture(scope="module")
def known():
    return _ssdtrain_flags(), _megatron_flags(), _make_targets()


@pytest.mark.parametrize("rel", DOCS)
def test_every_command_shown_names_real_subcommands_flags_and_targets(rel, known):
    subs, megatron, make = known
    problems = []
    for where, command in _commands(rel):
        problems += command_problems(command, where, subs, megatron, make)
    assert problems == []


def test_the_checker_finds_what_does_not_exist(known):
    """The checks above can fail: a made-up flag, subcommand, target, path and link are found."""
    subs, megatron, make = known
    for bad in ("ssdtrain core-bench --manual-gc", "ssdtrain frobnicate", "make nosuchtarget",
                "torchrun -m ssdtrain_megatron.launch x.py --ssd-offload-nope",
                "ssdtrain plan --config configs/nope.yaml"):
        assert command_problems(bad, "here", subs, megatron, make), bad
    assert not command_problems("make venv-mcore-0.19 && ssdtrain plan --config configs/"
                                "llama3-8b.yaml --json", "here", subs, megatron, make)


def test_the_two_commands_of_the_first_screen_are_the_ones_ci_runs():
    """.ci/run runs `make test`; the README's first shell block is `make demo` and `make test`."""
    readme = _read("README.md")
    first = next(c for _, c in _shell_blocks(readme))
    assert first.startswith("make demo")
    block = readme[readme.index("```bash"):readme.index("```", readme.index("```bash") + 3)]
    assert "make test" in block
    assert re.search(r"^make test$", _read(".ci/run"), re.M)
    head = "\n".join(readme.splitlines()[:100])
    for said in ("performance targets not yet met", "pip install --no-deps", "--ssd-offload",
                 "plan-summary", "offload pays"):
        assert said in head, said


def _plan_table():
    spec = importlib.util.spec_from_file_location("plan_table",
                                                  os.path.join(REPO, "scripts", "plan_table.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def plan_table():
    """scripts/plan_table.py and its rows, planned once (about 4 s)."""
    module = _plan_table()
    return module, module.rows()


def test_the_plan_table_is_what_plan_table_py_prints(plan_table):
    """The README's table of where offload pays and the first screen's two sentences on it are
    the script's output. Broken variant (one row's gain printed with a point more): the table
    differs."""
    module, planned = plan_table
    readme = _read("README.md")
    block = readme[readme.index(module.BEGIN) + len(module.BEGIN):readme.index(module.END)]
    assert block.strip() == module.table(planned), "run: python scripts/plan_table.py --write"
    said = readme[readme.index(module.SUMMARY_BEGIN) + len(module.SUMMARY_BEGIN):
                  readme.index(module.SUMMARY_END)]
    assert said.strip() == module.summary(planned), "run: python scripts/plan_table.py --write"
    assert readme.index(module.SUMMARY_END) < readme.index("## Two commands"), "the first screen"


def test_the_plan_table_covers_the_jobs_users_run(plan_table):
    """8 to 512 GPUs, 4k to 128k context, dense and MoE, DGX H100 and GH200; rows where offload
    pays and rows where it does not, and the first screen counts them as the table does."""
    module, planned = plan_table
    assert {r.gpus for r in planned} >= {8, 64, 512}
    assert {r.node for r in planned} == {"dgx-h100", "gh200"}
    assert {module._shape(r.preset).seq_len for r in planned} >= {4096, 8192, 131072}
    assert any(module._shape(r.preset).num_experts for r in planned)
    assert any(r.pays for r in planned) and any(r.why.startswith("does not pay") for r in planned)
    counts = re.findall(r"in (\d+):", module.summary(planned))
    paying = sum(1 for r in planned if r.pays or r.why == "only offload fits")
    assert counts == [str(paying)]


@pytest.mark.parametrize("preset, node, gpus", [("llama3-8b-128k", "dgx-h100", 64),
                                                ("llama3-70b", "gh200", 64),
                                                ("qwen3-30b-a3b", "dgx-h100", 64)])
def test_each_row_is_what_plan_search_ranks_first(plan_table, preset, node, gpus, capsys):
    """The row's best without and with offload are what `ssdtrain plan --search` (every layout
    planned, not the bounded search the script runs) ranks first at the row's flags. Broken
    variant (plan/baseline.py stopping at the first layout planned): other layouts."""
    module, planned = plan_table
    from ssdtrain_megatron.tools.cli import main

    row = next(r for r in planned if (r.preset, r.node, r.gpus) == (preset, node, gpus))
    assert main([*module.command(preset, node, gpus), "--top", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    for key, best in (("without_offload", row.without), ("with_offload", row.with_)):
        d = out[key][0]
        s = best.shape
        assert (d["tp"], d["pp"], d["cp"], d["micro_batch"], d["recompute"]) == (
            s.tp, s.pp, s.cp, s.micro_batch, s.recompute), key
        assert d["tokens_per_s_per_gpu"] == pytest.approx(best.tokens_per_s_per_gpu, rel=1e-12)


def test_the_plan_table_is_made_with_the_flags_the_readme_shows():
    """The command above the table is the one plan_table.py gives its llama3-70b row on 64
    GPUs of a DGX H100. Broken variant (plan_table.py planning another global batch): the
    command is not in the README."""
    module = _plan_table()
    readme = _read("README.md")
    assert f"`{shlex.join(['ssdtrain', *module.command('llama3-70b')])}`" in " ".join(readme.split())


def test_the_gpu_check_docs_give_gpu_check_py_defaults():
    """docs/gpu-check.md's measure shape and micro-batch sizes are gpu_check.py's defaults."""
    from ssdtrain_megatron.tools.gpucheck.gpu_check import parse_args

    d = parse_args([])
    text = " ".join(_read(os.path.join("docs", "gpu-check.md")).split())
    assert (f"at {d.layers} layers, hidden {d.hidden}, seq {d.seq}") in text
    assert f"at micro-batch {d.micro_batch} and at {d.micro_batch + 1} under a memory budget" in text


def test_bench_quick_help_says_what_was_measured():
    """bench --quick took 53 s on the loaded 2-core machine (docs/benchmarks.md), not 3 minutes."""
    from ssdtrain_megatron.tools.cli import build_parser

    bench = build_parser()._subparsers._group_actions[0].choices["bench"]  # noqa: SLF001
    quick = next(a for a in bench._actions if "--quick" in a.option_strings)  # noqa: SLF001
    assert "about a minute" in quick.help and "3 minutes" not in quick.help
    assert "53 s wall clock" in _read(os.path.join("docs", "benchmarks.md"))
