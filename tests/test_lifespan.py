"""SSD lifespan arithmetic (the paper's Sec. III-D) and `ssdtrain lifespan`."""

import argparse
import json

import pytest

from ssdtrain_megatron.tools.plan.cli import add_lifespan_parser, add_plan_parser
from ssdtrain_megatron.plan.lifespan import endurance_bytes, ssd_lifespan

# The paper's worked example: 4 drives of 1 TB rated 600 TBW each, WAF 2.5 -> 1, 86x retention
# relaxation, 12.1 GB/s peak write per GPU, writing during half of each step.
PAPER_YEARS = 4 * 600e12 * 2.5 * 86 / (12.1e9 * 0.5 * 86400 * 365.25)


def main(argv):
    parser = argparse.ArgumentParser(prog="ssdtrain")
    sub = parser.add_subparsers(dest="command", required=True)
    add_lifespan_parser(sub)
    add_plan_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_paper_worked_example_lasts_more_than_two_years():
    result = ssd_lifespan(4, 600, 12.1, 0.5, waf_rated=2.5, waf=1.0, retention_factor=86)
    assert result.lifespan_years == PAPER_YEARS
    assert result.lifespan_years == 2.702653440006436
    assert result.lifespan_years > 2
    assert result.endurance_bytes == 516_000_000_000_000_000  # 4 x 600e12 x 2.5 x 86
    assert result.bytes_per_day == 522_720_000_000_000  # 12.1e9 x 0.5 x 86400


def test_defaults_are_the_papers_factors():
    assert ssd_lifespan(4, 600, 12.1, 0.5) == ssd_lifespan(4, 600, 12.1, 0.5, waf_rated=2.5,
                                                           waf=1.0, retention_factor=86)


def test_writing_half_as_often_doubles_the_lifespan():
    half = ssd_lifespan(4, 600, 12.1, 0.25)
    assert half.lifespan_years == 2 * PAPER_YEARS
    assert half.bytes_per_day == 261_360_000_000_000


def test_endurance_without_corrections_is_the_rated_tbw():
    assert endurance_bytes(2, 300, waf_rated=1.0, waf=1.0, retention_factor=1.0) == 600e12


@pytest.mark.parametrize("kwargs, message", [
    (dict(drives=0), "drives=0 is invalid"),
    (dict(tbw_per_drive_tb=0), "tbw_per_drive_tb=0 is invalid"),
    (dict(write_gbps=-1.0), "write_gbps=-1.0 is invalid"),
    (dict(write_fraction=1.5), "write_fraction=1.5 is invalid: expected a number in (0, 1]"),
    (dict(waf=0), "waf=0 is invalid"),
    (dict(retention_factor=-86), "retention_factor=-86 is invalid"),
])
def test_invalid_lifespan_inputs_name_the_parameter(kwargs, message):
    args = dict(drives=4, tbw_per_drive_tb=600, write_gbps=12.1, write_fraction=0.5)
    args.update(kwargs)
    with pytest.raises(ValueError) as err:
        ssd_lifespan(**args)
    assert message in str(err.value)


PAPER_ARGV = ["lifespan", "--drives", "4", "--tbw-per-drive", "600", "--write-gbps", "12.1",
              "--write-fraction", "0.5"]


def test_cli_json_reproduces_the_worked_example(capsys):
    assert main(PAPER_ARGV + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {"lifespan_years": PAPER_YEARS, "endurance_bytes": 5.16e17,
                   "bytes_per_day": 5.2272e14,
                   "rated_lifespan_years": 2.4e15 / (12.1e9 * 0.5 * 86400 * 365.25)}


def test_cli_table_prints_exact_figures(capsys):
    assert main(PAPER_ARGV) == 0
    assert capsys.readouterr().out.splitlines() == [
        "drives             4 x 600 TBW",
        "write rate         12.1 GB/s x 0.5",
        "bytes per day      522,720,000,000,000 B (522.720 TB)",
        "rated lifespan     4.6 days: the rated 2,400 TB written at 522.7 TB per day",
        "WAF correction     2.5 / 1 = 2.5x",
        "retention factor   86x",
        "endurance          516,000,000,000,000,000 B (516.000 PB)",
        "lifespan           2.7027 years (987.1 days) = rated x 215 (WAF correction x retention "
        "factor: the paper's estimates, not a rating)",
    ]


def test_the_rated_figure_comes_first_and_the_factors_are_named(capsys):
    """The issue's example: one 7000 TBW drive at 5.3 GB/s half the time lasts about a month
    by its rating; 18 years only with the paper's 2.5 x 86 = 215x."""
    assert main(["lifespan", "--drives", "1", "--tbw-per-drive", "7000", "--write-gbps", "5.3",
                 "--write-fraction", "0.5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rated = next(i for i, ln in enumerate(lines) if ln.startswith("rated lifespan"))
    paper = next(i for i, ln in enumerate(lines) if ln.startswith("lifespan"))
    assert rated < paper
    assert lines[rated] == "rated lifespan     30.6 days: the rated 7,000 TB written at 229.0 TB per day"
    assert lines[paper].startswith("lifespan           17.9964 years (6,573.2 days) = rated x 215 ")
    r = ssd_lifespan(1, 7000, 5.3, 0.5)
    assert r.rated_lifespan_years == 7000e12 / (5.3e9 * 0.5 * 86400 * 365.25)
    assert r.adjustment == pytest.approx(215.0, rel=1e-12)


def test_cli_factors_override_the_defaults(capsys):
    assert main(PAPER_ARGV + ["--waf-rated", "1", "--retention-factor", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["endurance_bytes"] == 2.4e15
    assert out["lifespan_years"] == 2.4e15 / (12.1e9 * 0.5 * 86400 * 365.25)


@pytest.mark.parametrize("flag, value, message", [
    ("--drives", "0", "argument --drives: expected an integer >= 1, got '0'"),
    ("--drives", "two", "argument --drives: expected an integer >= 1, got 'two'"),
    ("--write-fraction", "0", "argument --write-fraction: expected a number in (0, 1], got '0'"),
    ("--write-gbps", "-3", "argument --write-gbps: expected a number > 0, got '-3'"),
    ("--waf", "nan", "argument --waf: expected a number > 0, got 'nan'"),
])
def test_cli_rejects_bad_flags_naming_the_flag(capsys, flag, value, message):
    argv = list(PAPER_ARGV)
    if flag in argv:
        argv[argv.index(flag) + 1] = value
    else:
        argv += [flag, value]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"ssdtrain lifespan: error: {message}"
