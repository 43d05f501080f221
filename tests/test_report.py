"""`ssdtrain report`: the IO characteristics of a trace with known contents, figure by figure.

The trace (times in binary fractions, so sums and spans are exact floats):
- rank 0, forward: 10 sequential 8 MiB writes to one slab file, offsets 0..72 MiB, submitted
  every 0.125 s from t = 0.5, 0.0625 s each, queue depths 1, 2, then 3; steps 0 (6) and 1 (4).
- rank 0, backward, step 1: 4 random 1 MiB reads of the same file at t = 2.0, 2.25, 2.5,
  2.75, 0.25 s each (last completion t = 3.0), queue depths 1, 2, 2, 2.
- rank 1, step_end, step 1: one 3 MiB write to the *same path* at offset 80 MiB (where rank
  0's next write would go) at t = 1.0, 0.5 s long, queue depth 1. Per-rank streams keep it
  from making rank 0 look less sequential, and itself contiguous.
Lines are written out of order (the tracer appends in completion order).
"""

from __future__ import annotations

import argparse
import json
import sys

import pytest

from ssdtrain_megatron.telemetry.report import TraceError, analyze, load_trace, nice_bucket_s, size_bucket
from ssdtrain_megatron.tools.report import add_report_parser

MiB = 1 << 20
SLAB = "/ssd/offload/rank0.slab"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _rec(t, rank, step, phase, op, nbytes, offset, latency, qd, file=SLAB, layer="3"):
    return {"t": t, "rank": rank, "step": step, "microbatch": "0", "layer": layer,
            "phase": phase, "op": op, "bytes": nbytes, "file": file, "offset": offset,
            "latency_s": latency, "queue_depth": qd}


def known_records():
    writes = [_rec(0.5 + 0.125 * i, 0, 0 if i < 6 else 1, "forward", "write", 8 * MiB,
                   i * 8 * MiB, 0.0625, [1, 2][i] if i < 2 else 3, layer=str(i))
              for i in range(10)]
    reads = [_rec(t, 0, 1, "backward", "read", MiB, off * MiB, 0.25, qd)
             for t, off, qd in ((2.0, 40, 1), (2.25, 8, 2), (2.5, 64, 2), (2.75, 16, 2))]
    rank1 = _rec(1.0, 1, 1, "step_end", "write", 3 * MiB, 80 * MiB, 0.5, 1, layer=None)
    return writes, reads, rank1


@pytest.fixture
def trace(tmp_path):
    writes, reads, rank1 = known_records()
    path = tmp_path / "trace.jsonl"
    lines = [rank1] + reads[::-1] + writes[5:] + writes[:5]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + "\n")
    return str(path)


def _run(*argv):
    parser = argparse.ArgumentParser(prog="ssdtrain")
    add_report_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["report", *argv])
    return args.func(args)


def test_size_bucket_is_the_largest_power_of_two_not_above_the_size():
    assert [size_bucket(n) for n in (0, 1, 4095, 4096, 3 * MiB, 8 * MiB, 8 * MiB + 1)] == \
        [0, 1, 2048, 4096, 2 * MiB, 8 * MiB, 8 * MiB]


def test_automatic_bucket_is_a_1_2_5_width_giving_at_most_50_buckets():
    assert nice_bucket_s(2.5) == pytest.approx(0.05)
    assert nice_bucket_s(10.0) == pytest.approx(0.2)
    assert nice_bucket_s(7.0) == pytest.approx(0.2)
    assert nice_bucket_s(400.0) == pytest.approx(10.0)
    assert nice_bucket_s(0.0) == 1.0


def test_known_trace_gives_exact_mix_sizes_and_sequentiality(trace):
    f = analyze(load_trace(trace))
    assert f["requests"] == 15
    assert f["ranks"] == [0, 1]
    assert f["span_s"] == 2.5

    w, r = f["mix"]["write"], f["mix"]["read"]
    assert (w["requests"], w["bytes"]) == (11, 83 * MiB)
    assert (r["requests"], r["bytes"]) == (4, 4 * MiB)
    assert w["request_share"] == 11 / 15 and r["request_share"] == 4 / 15
    assert w["byte_share"] == 83 / 87 and r["byte_share"] == 4 / 87
    assert w["latency_mean_s"] == 1.125 / 11 and w["latency_max_s"] == 0.5
    assert r["latency_mean_s"] == 0.25 and r["latency_max_s"] == 0.25

    assert f["phases"] == {
        "forward": {"write": {"requests": 10, "bytes": 80 * MiB}, "read": {"requests": 0, "bytes": 0}},
        "backward": {"write": {"requests": 0, "bytes": 0}, "read": {"requests": 4, "bytes": 4 * MiB}},
        "step_end": {"write": {"requests": 1, "bytes": 3 * MiB}, "read": {"requests": 0, "bytes": 0}},
    }
    assert f["request_sizes"] == [
        {"bucket_bytes": MiB, "write": 0, "read": 4},
        {"bucket_bytes": 2 * MiB, "write": 1, "read": 0},
        {"bucket_bytes": 8 * MiB, "write": 10, "read": 0},
    ]
    # Rank 0's writes: 9 of 10 follow their predecessor (the first has none); its reads are
    # random; rank 1's write is its first to the file, though it sits where rank 0 would go.
    assert f["sequentiality"] == {
        "write": {"requests": 11, "contiguous": 9, "share": 9 / 11},
        "read": {"requests": 4, "contiguous": 0, "share": 0.0},
        "all": {"requests": 15, "contiguous": 9, "share": 9 / 15},
    }


def test_known_trace_gives_exact_queue_depths_and_steps(trace):
    f = analyze(load_trace(trace))
    assert f["queue_depth"] == {
        "histogram": [{"depth": 1, "requests": 3}, {"depth": 2, "requests": 4},
                      {"depth": 3, "requests": 8}],
        "mean": 35 / 15,
        "max": 3,
        "per_rank": [{"rank": 0, "mean": 34 / 14, "max": 3}, {"rank": 1, "mean": 1.0, "max": 1}],
    }
    assert f["steps"] == [
        {"step": 0, "bytes_written": 48 * MiB, "bytes_read": 0, "writes": 6, "reads": 0,
         "bytes_unread": 48 * MiB},
        {"step": 1, "bytes_written": 35 * MiB, "bytes_read": 4 * MiB, "writes": 5, "reads": 4,
         "bytes_unread": 31 * MiB},
    ]


def test_timeline_spreads_bytes_over_each_request_and_sums_ranks(trace):
    tl = analyze(load_trace(trace), bucket_s=0.25)["timeline"]
    assert (tl["start_s"], tl["bucket_s"], tl["buckets"]) == (0.5, 0.25, 10)
    gbps = lambda nbytes: nbytes / 0.25 / 1e9  # noqa: E731
    bw = tl["bandwidth_gbps"]
    # Two 8 MiB writes start in each of the first five buckets and finish inside it.
    assert bw["forward"]["write"] == [gbps(16 * MiB)] * 5 + [0.0] * 5
    # Rank 1's 3 MiB write runs from 1.0 to 1.5 s: half in bucket 2, half in bucket 3.
    assert bw["step_end"]["write"] == [0.0, 0.0, gbps(1.5 * MiB), gbps(1.5 * MiB)] + [0.0] * 6
    assert bw["backward"]["read"] == [0.0] * 6 + [gbps(MiB)] * 4
    assert bw["forward"]["read"] == bw["backward"]["write"] == bw["step_end"]["read"] == [0.0] * 10
    assert tl["queue_depth_mean"] == [1.5, 3.0, 7 / 3, 3.0, 3.0, None, 1.0, 2.0, 2.0, 2.0]
    assert tl["queue_depth_max"] == [2, 3, 3, 3, 3, None, 1, 2, 2, 2]


def test_drive_writes_per_day_at_the_observed_rate(trace):
    en = analyze(load_trace(trace), drive_tb=3.84)["endurance"]
    # By hand: bytes written / span * 86400 / 3.84e12.
    # rank 0: 83,886,080 B / 2.5 s = 33,554,432 B/s -> 2,899,102,924,800 B/day -> 0.75497472
    # rank 1:  3,145,728 B / 0.5 s =  6,291,456 B/s ->   543,581,798,400 B/day -> 0.14155776
    # all:    87,031,808 B / 2.5 s = 34,812,723.2 B/s -> 3,007,819,284,480 B/day -> 0.783286272
    assert en["drive_tb"] == 3.84
    r0, r1 = en["per_rank"]
    assert (r0["rank"], r0["bytes_written"], r0["span_s"]) == (0, 80 * MiB, 2.5)
    assert r0["write_gbps"] == pytest.approx(0.033554432, rel=1e-12)
    assert r0["dwpd"] == pytest.approx(0.75497472, rel=1e-12)
    assert (r1["rank"], r1["bytes_written"], r1["span_s"]) == (1, 3 * MiB, 0.5)
    assert r1["dwpd"] == pytest.approx(0.14155776, rel=1e-12)
    assert en["all_ranks"]["bytes_written"] == 83 * MiB
    assert en["all_ranks"]["dwpd"] == pytest.approx(0.783286272, rel=1e-12)
    assert analyze(load_trace(trace), drive_tb=1.92)["endurance"]["per_rank"][0]["dwpd"] == \
        pytest.approx(2 * 0.75497472, rel=1e-12)


def test_report_writes_markdown_and_readable_pngs(trace, tmp_path, capsys):
    out = tmp_path / "report"
    assert _run(trace, "--out", str(out)) == 0
    printed = capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert printed == md
    for heading in ("## Read/write mix", "## Request sizes", "## Sequentiality",
                    "## Queue depth at submit", "## Bandwidth and queue depth over time",
                    "## Bytes per step", "## Drive writes per day (3.84 TB drive)"):
        assert heading in md
    assert "| 8 MiB | 10 | 0 | 10 |" in md
    assert "| write | 11 | 9 | 81.8% |" in md
    assert "| 0 | 83,886,080 (83.9 MB) | 2.5 | 0.03355 | 0.755 |" in md
    for name in ("request_sizes.png", "queue_depth.png", "bandwidth.png"):
        data = (out / name).read_bytes()
        assert data[:8] == PNG_MAGIC
        assert len(data) > 10_000, name


def test_json_prints_one_object_with_every_figure(trace, tmp_path, capsys):
    assert _run(trace, "--json", "--drive-tb", "1.92", "--bucket-s", "0.5") == 0
    obj = json.loads(capsys.readouterr().out)
    assert set(obj) == {"trace", "requests", "ranks", "span_s", "mix", "phases",
                        "request_sizes", "sequentiality", "queue_depth", "timeline", "steps",
                        "endurance", "files"}
    assert obj["trace"] == trace and obj["files"] == []
    assert set(obj["mix"]["write"]) == {"requests", "bytes", "request_share", "byte_share",
                                        "latency_mean_s", "latency_max_s"}
    assert set(obj["timeline"]) == {"start_s", "bucket_s", "buckets", "bandwidth_gbps",
                                    "queue_depth_mean", "queue_depth_max"}
    assert obj["timeline"]["buckets"] == 5
    assert obj["timeline"]["queue_depth_mean"] == [9 / 4, 13 / 5, 3.0, 1.5, 2.0]
    assert obj["endurance"]["drive_tb"] == 1.92
    assert obj["endurance"]["per_rank"][0]["dwpd"] == pytest.approx(2 * 0.75497472, rel=1e-12)


def test_json_with_out_lists_the_files_and_prints_no_markdown(trace, tmp_path, capsys):
    out = tmp_path / "o"
    assert _run(trace, "--json", "--out", str(out)) == 0
    obj = json.loads(capsys.readouterr().out)
    assert [p.rsplit("/", 1)[1] for p in obj["files"]] == \
        ["report.md", "request_sizes.png", "queue_depth.png", "bandwidth.png"]


def test_out_without_matplotlib_is_exit_code_2_and_writes_nothing(trace, tmp_path, capsys,
                                                                   monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # makes `import matplotlib` fail
    out = tmp_path / "o"
    assert _run(trace, "--out", str(out)) == 2
    assert capsys.readouterr().err == \
        "ssdtrain report: error: --out needs matplotlib for the plots " \
        "(pip install 'ssdtrain-megatron[plot]')\n"
    assert not out.exists()


@pytest.mark.parametrize("line, message", [
    ("{not json", "trace.jsonl:3: not valid JSON"),
    ("[1, 2]", "trace.jsonl:3: expected a JSON object, got list"),
    ('{"t": 1.0, "rank": 0}', "trace.jsonl:3: missing key(s) step, microbatch, layer, phase, "
                              "op, bytes, file, offset, latency_s, queue_depth"),
])
def test_malformed_line_is_one_error_line_naming_file_and_line(tmp_path, capsys, line, message):
    writes, _, _ = known_records()
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(writes[0]) + "\n\n" + line + "\n" + json.dumps(writes[1]) + "\n")
    assert _run(str(path)) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith(f"ssdtrain report: error: {tmp_path}/{message}")


@pytest.mark.parametrize("key, value, expected", [
    ("op", "flush", "'op' must be one of write, read, got 'flush'"),
    ("phase", "warmup", "'phase' must be one of forward, backward, step_end"),
    ("bytes", -1, "'bytes' must be an integer >= 0, got -1"),
    ("offset", 1.5, "'offset' must be an integer >= 0, got 1.5"),
    ("queue_depth", 0, "'queue_depth' must be an integer >= 1, got 0"),
    ("latency_s", "fast", "'latency_s' must be a number >= 0"),
    ("microbatch", 3, "'microbatch' must be a string or null, got 3"),
])
def test_invalid_value_names_the_key_and_line(tmp_path, key, value, expected):
    writes, _, _ = known_records()
    bad = dict(writes[1], **{key: value})
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(writes[0]) + "\n" + json.dumps(bad) + "\n")
    with pytest.raises(TraceError, match="^" + str(path) + ":2: " + expected.replace("(", r"\(")):
        load_trace(str(path))


def test_missing_or_empty_trace_is_exit_code_2(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    assert _run(str(missing)) == 2
    assert capsys.readouterr().err == \
        f"ssdtrain report: error: {missing}: cannot read: No such file or directory\n"
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert _run(str(empty)) == 2
    assert f"{empty}: no IO records" in capsys.readouterr().err
