"""`ssdtrain bench --verify off,crc32c`: offload with and without verification side by side in
one run, so that the cost of checksums is a paired ratio (issue 28, section 3)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*"),
              pytest.mark.filterwarnings("ignore::UserWarning:megatron.*")]

from ssdtrain_megatron.tools.bench.cli import summarize  # noqa: E402
from tests.test_bench import TINY, _bench, _run  # noqa: E402


TINY_MB1 = ["1" if a == "1,2" else a for a in TINY]


def test_verify_off_and_crc32c_runs_offload_both_ways_in_one_run(tmp_path, capsys, monkeypatch):
    """``--verify off,crc32c`` adds offload+crc32c beside offload (verify off): same losses,
    both offload, and only the verified one checksums (a real run; the checksum function is
    wrapped to count the bytes it sees). Break: drop ``**changes`` where _Contender builds its
    offloader (bench/measure.py) -> 'assert 0 > 0' on the checksummed bytes."""
    from ssdtrain_megatron.io import bounce  # where the engine checksums its chunks

    seen = []
    real = bounce.checksum
    monkeypatch.setattr(bounce, "checksum", lambda buf: seen.append(len(memoryview(buf).cast("B"))) or real(buf))
    rc = _bench(["--json", "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "ssd"),
                 "--strategies", "offload", "--verify", "off,crc32c", *TINY_MB1])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    result = json.loads(captured.out)
    assert [p["strategy"] for p in result["points"]] == ["keep", "offload", "offload+crc32c"]
    assert result["losses_bitwise_equal"] is True
    diag = result["diagnostics"]
    assert diag["offload@1"]["bytes_offloaded"] > 0 and diag["offload+crc32c@1"]["bytes_offloaded"] > 0
    assert sum(seen) > 0
    assert {"offload+crc32c_vs_offload_step_time", "offload+crc32c_vs_offload_cpu_time"} <= set(result["ratios"])
    assert "offload+crc32c_vs_offload_step_time" in result["ratio_spread"]


def test_only_verify_off_checksums_nothing(tmp_path, capsys, monkeypatch):
    """The other side of the test above: with ``--verify off`` alone nothing is checksummed
    and no offload+crc32c runs."""
    from ssdtrain_megatron.io import bounce  # where the engine checksums its chunks

    seen = []
    monkeypatch.setattr(bounce, "checksum", lambda buf: seen.append(1) or 0)
    rc = _bench(["--json", "--out", str(tmp_path / "out"), "--dir", str(tmp_path / "ssd"),
                 "--strategies", "offload", "--verify", "off", *TINY_MB1])
    result = json.loads(capsys.readouterr().out)
    assert rc == 0 and [p["strategy"] for p in result["points"]] == ["keep", "offload"]
    assert seen == []


def test_verify_ratios_compare_offload_crc32c_with_offload():
    same = [1.0, 0.9]
    run = _run({("keep", 1): ([1.0, 1.0], [100, 100], same), ("offload", 1): ([2.0, 2.0], [90, 90], same),
                ("offload+crc32c", 1): ([2.1, 2.1], [90, 90], same)})
    run.series[("offload+crc32c", 1)].cpu = [1.5, 1.5]
    s = summarize(run)
    assert s["ratios"]["offload+crc32c_vs_offload_step_time"] == 2.1 / 2.0
    assert s["ratios"]["offload+crc32c_vs_offload_cpu_time"] == 1.5
    assert [p["strategy"] for p in s["points"]] == ["keep", "offload", "offload+crc32c"]
    from ssdtrain_megatron.tools.bench.render import render

    assert "offload+crc32c / offload step time   1.05" in render(s)


@pytest.mark.parametrize("argv, message", [
    (["--strategies", "offload,fast"], "expected names among keep, offload, host, planned, adaptive, recompute"),
    (["--verify", "md5"], "expected one or both of off, crc32c"),
])
def test_bad_strategy_or_verify_values_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _bench(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
