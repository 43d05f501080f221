"""The --ssd-offload flag group: generated from OffloadConfig, defaults < preset < flags, bad
values stop parsing with one line that names the flag. The launcher's hooks:
test_args_launcher.py."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys

import pytest

from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.megatron.args import (add_ssd_offload_args, config_from_args, dest_for,
                                             explicit_fields, flag_for, given_flags,
                                             megatron_args_from_preset, with_ssd_offload_args)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _parser() -> argparse.ArgumentParser:
    return add_ssd_offload_args(argparse.ArgumentParser(prog="pretrain_gpt.py"))


def _fails(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        _parser().parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def _preset(tmp_path, offload: str) -> str:
    path = tmp_path / "preset.yaml"
    path.write_text("model:\n  num_layers: 2\n  hidden: 64\n  heads: 4\n  ffn_hidden: 256\n"
                    "  seq_len: 32\n  micro_batch: 2\nparallel:\n  tp: 1\n  pp: 1\n"
                    "offload:\n" + offload)
    return str(path)


# -- the group -------------------------------------------------------------------------------


def test_group_has_the_named_flags_and_one_flag_per_remaining_field():
    parser = _parser()
    group = next(g for g in parser._action_groups if g.title == "ssd offload")
    flags = {s for a in group._group_actions for s in a.option_strings}
    named = {"--ssd-offload", "--ssd-offload-dir", "--ssd-offload-engine", "--ssd-offload-config",
             "--ssd-offload-policy", "--ssd-offload-recompute-fallback"}
    assert named <= flags
    for f in dataclasses.fields(OffloadConfig):
        assert flag_for(f.name) in flags, f.name
    # Exactly: --ssd-offload, --ssd-offload-config, --ssd-offload-node, one per field, and --no- forms of booleans,
    # plus the hidden deprecated spellings (an old on/off switch has a --no- form too).
    booleans = [f.name for f in dataclasses.fields(OffloadConfig) if f.type in (bool, "bool")]
    old = [n for f in dataclasses.fields(OffloadConfig) for n in f.metadata["deprecated_flags"]]
    switches = [f.name for f in dataclasses.fields(OffloadConfig) if f.metadata["deprecated_switch"]]
    assert len(flags) == 3 + len(dataclasses.fields(OffloadConfig)) + len(booleans) + len(old) \
        + 2 * len(switches)


def test_flag_names_follow_the_fields():
    assert flag_for("dirs") == "--ssd-offload-dir"
    assert flag_for("keep_last_layers") == "--ssd-offload-keep-last-layers"
    assert dest_for("keep_last_layers") == "ssd_offload_keep_last_layers"
    assert dest_for("dirs") == "ssd_offload_dir"


def test_nothing_given_is_the_default_config_and_offload_is_off():
    args = _parser().parse_args([])
    assert args.ssd_offload is False
    assert explicit_fields(args) == {}
    assert given_flags(args) == []
    assert config_from_args(args) == OffloadConfig()


def test_flags_set_their_fields():
    args = _parser().parse_args([
        "--ssd-offload", "--ssd-offload-dir", "/mnt/nvme{local_rank}/a/{job}, /mnt/b",
        "--ssd-offload-engine", "tiered", "--ssd-offload-policy", "keep",
        "--ssd-offload-io-threads", "8", "--ssd-offload-chunk-bytes", "4MiB",
        "--ssd-offload-verify", "crc32c", "--ssd-offload-io-timeout-s", "12.5",
        "--ssd-offload-recompute-fallback", "--ssd-offload-recompute-layers", "1,3-5",
        "--ssd-offload-job", "j42"])
    cfg = config_from_args(args)
    assert cfg.dirs == ["/mnt/nvme{local_rank}/a/{job}", "/mnt/b"]
    assert (cfg.engine, cfg.policy, cfg.io_threads) == ("tiered", "keep", 8)
    assert cfg.chunk_bytes == 4 << 20
    assert cfg.verify == "crc32c" and cfg.io_timeout_s == 12.5
    assert cfg.recompute_fallback is True and cfg.recompute_layers == [1, 3, 4, 5]
    assert cfg.job == "j42"
    assert cfg.min_tensor_bytes == OffloadConfig().min_tensor_bytes


def test_no_form_of_a_boolean_sets_false():
    args = _parser().parse_args(["--no-ssd-offload-recompute-fallback"])
    assert explicit_fields(args) == {"recompute_fallback": False}


def test_preset_overrides_defaults_and_flags_override_preset(tmp_path):
    preset = _preset(tmp_path, "  dirs: ['/mnt/nvme{local_rank}/p/{job}']\n  io_threads: 6\n"
                               "  policy: adaptive\n  verify: crc32c\n")
    args = _parser().parse_args(["--ssd-offload", "--ssd-offload-config", preset,
                                 "--ssd-offload-io-threads", "2", "--ssd-offload-verify", "off"])
    cfg = config_from_args(args)
    assert cfg.dirs == ["/mnt/nvme{local_rank}/p/{job}"]  # preset
    assert cfg.policy == "adaptive"                       # preset
    assert cfg.io_threads == 2                            # flag over preset
    assert cfg.verify == "off"                            # flag over preset
    assert cfg.prefetch_layers == OffloadConfig().prefetch_layers  # default
    assert given_flags(args) == ["--ssd-offload-config", "--ssd-offload-verify",
                                 "--ssd-offload-io-threads"]  # in OffloadConfig's field order


def test_every_shipped_preset_composes_with_flags():
    for name in sorted(os.listdir(os.path.join(REPO, "configs"))):
        if name.endswith(".yaml"):
            path = os.path.join(REPO, "configs", name)
            args = _parser().parse_args(["--ssd-offload", "--ssd-offload-config", path,
                                         "--ssd-offload-dir", "/tmp/x"])
            cfg = config_from_args(args)
            assert cfg.dirs == ["/tmp/x"]
            assert cfg.policy == OffloadConfig.from_yaml(path).policy


# -- bad values fail at parse time, in one line naming the flag ------------------------------


@pytest.mark.parametrize("argv, line", [
    (["--ssd-offload-io-threads", "0"],
     "pretrain_gpt.py: error: argument --ssd-offload-io-threads: 0 is invalid: "
     "expected an integer >= 1"),
    (["--ssd-offload-io-threads", "four"],
     "pretrain_gpt.py: error: argument --ssd-offload-io-threads: 'four' is invalid: "
     "expected an integer"),
    (["--ssd-offload-chunk-bytes", "5000"],
     "pretrain_gpt.py: error: argument --ssd-offload-chunk-bytes: 5000 is invalid: "
     "expected a multiple of 4096"),
    (["--ssd-offload-chunk-bytes", "3PB"],
     "pretrain_gpt.py: error: argument --ssd-offload-chunk-bytes: '3PB' is invalid: "
     "expected a size: bytes, or a number with a unit kB, MB, GB, TB (10^3...) or KiB, MiB, "
     "GiB, TiB (2^10...), e.g. 80GB or 512MiB"),
    (["--ssd-offload-engine", "nvme"],
     "pretrain_gpt.py: error: argument --ssd-offload-engine: 'nvme' is invalid: "
     "allowed: posix, aio, gds, memory, tiered"),
    (["--ssd-offload-policy", "sometimes"],
     "pretrain_gpt.py: error: argument --ssd-offload-policy: 'sometimes' is invalid: "
     "allowed: offload, adaptive, keep"),
    (["--ssd-offload-dir", "/mnt/{drive}"],
     "pretrain_gpt.py: error: argument --ssd-offload-dir: '/mnt/{drive}' is invalid: unknown "
     "placeholder {drive}; allowed: {rank}, {local_rank}, {hostname}, {job}, {user}"),
    (["--ssd-offload-dir", "/a,,/b"],
     "pretrain_gpt.py: error: argument --ssd-offload-dir: '/a,,/b' is invalid: expected "
     "comma-separated items, none of them empty"),
    (["--ssd-offload-io-timeout-s", "inf"],
     "pretrain_gpt.py: error: argument --ssd-offload-io-timeout-s: 'inf' is invalid: "
     "expected a finite number"),
    (["--ssd-offload-recompute-layers", "0,1"],
     "pretrain_gpt.py: error: argument --ssd-offload-recompute-layers: [0, 1] is invalid: "
     "expected a list of layer numbers >= 1"),
    (["--ssd-offload-config", "/nonexistent/preset.yaml"],
     "pretrain_gpt.py: error: argument --ssd-offload-config: /nonexistent/preset.yaml: no such "
     "file and no preset of that name; presets: cpu-tiny, gpt3-1.3b, llama2-13b, llama2-7b, "
     "llama3-70b, llama3-8b, llama3-8b-128k, llama3-8b-dgx, mixtral-8x7b, qwen3-30b-a3b"),
])
def test_bad_value_fails_at_parse_time_naming_the_flag(argv, line, capsys):
    assert _fails(argv, capsys) == line


def test_bad_combination_fails_at_parse_time_naming_the_flag(capsys):
    line = _fails(["--ssd-offload", "--ssd-offload-engine", "memory",
                   "--ssd-offload-host-memory-bytes", "0"], capsys)
    assert line == ("pretrain_gpt.py: error: argument --ssd-offload-host-memory-bytes: 0 is "
                    "invalid: engine='memory' needs a pool; expected an integer > 0")


def test_bad_combination_from_the_preset_names_the_preset(tmp_path, capsys):
    preset = _preset(tmp_path, "  host_memory_bytes: 0\n")
    line = _fails(["--ssd-offload", "--ssd-offload-config", preset,
                   "--ssd-offload-engine", "memory"], capsys)
    assert line.startswith(f"pretrain_gpt.py: error: argument --ssd-offload-config: {preset}: ")
    assert "host_memory_bytes=0" in line


def test_invalid_preset_fails_at_parse_time(tmp_path, capsys):
    preset = _preset(tmp_path, "  io_threads: 0\n")
    line = _fails(["--ssd-offload-config", preset], capsys)
    assert line == ("pretrain_gpt.py: error: argument --ssd-offload-config: "
                    "OffloadConfig.io_threads=0 is invalid: expected an integer >= 1")
    preset = _preset(tmp_path, "  drives: 3\n")
    assert "unknown key(s) drives" in _fails(["--ssd-offload-config", preset], capsys)
    broken = tmp_path / "broken.yaml"
    broken.write_text("offload: [unclosed\n")
    line = _fails(["--ssd-offload-config", str(broken)], capsys)
    assert line.startswith(f"pretrain_gpt.py: error: argument --ssd-offload-config: "
                           f"'{broken}' is not valid YAML: ")


def test_combination_is_checked_only_with_offload_on():
    # Without --ssd-offload the knobs are inert; nothing may stop the run.
    args = _parser().parse_args(["--ssd-offload-engine", "memory",
                                 "--ssd-offload-host-memory-bytes", "0"])
    assert args.ssd_offload is False


# -- composition with Megatron's parser ------------------------------------------------------


def test_adding_the_group_twice_is_harmless():
    parser = _parser()
    assert add_ssd_offload_args(parser) is parser
    assert parser.parse_args(["--ssd-offload"]).ssd_offload is True


def test_with_ssd_offload_args_runs_the_scripts_own_provider_first():
    def modelopt(parser):
        parser.add_argument("--modelopt-flag", type=int, default=0)
        return parser

    parser = with_ssd_offload_args(modelopt)(argparse.ArgumentParser())
    args = parser.parse_args(["--modelopt-flag", "3", "--ssd-offload"])
    assert (args.modelopt_flag, args.ssd_offload) == (3, True)
    assert with_ssd_offload_args(None) is add_ssd_offload_args


def test_module_does_not_import_megatron():
    code = ("import sys, ssdtrain_megatron.megatron.args, ssdtrain_megatron.megatron.launch; "
            "print([m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- presets as Megatron flags ---------------------------------------------------------------


def test_megatron_args_from_preset_carry_shape_layout_and_precision():
    flags = megatron_args_from_preset(os.path.join(REPO, "configs", "llama3-70b.yaml"))
    assert flags == [
        "--num-layers", "80", "--hidden-size", "8192", "--num-attention-heads", "64",
        "--ffn-hidden-size", "28672", "--seq-length", "8192", "--max-position-embeddings", "8192",
        "--micro-batch-size", "1", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
        "--group-query-attention", "--num-query-groups", "8", "--bf16", "--swiglu",
        "--sequence-parallel", "--use-distributed-optimizer"]


def test_a_preset_with_unfused_swiglu_asks_megatron_for_it(tmp_path):
    """The planner's ``swiglu_fusion: false`` is Megatron-LM's ``--no-bias-swiglu-fusion``:
    the flags must run the path the plan counted."""
    text = open(os.path.join(REPO, "configs", "llama3-70b.yaml"), encoding="utf-8").read()
    preset = tmp_path / "unfused.yaml"
    preset.write_text(text.replace("  swiglu: true\n", "  swiglu: true\n  swiglu_fusion: false\n"))
    flags = megatron_args_from_preset(str(preset))
    assert flags[flags.index("--swiglu") + 1] == "--no-bias-swiglu-fusion"


def test_megatron_args_command_prints_one_line_and_rejects_bad_presets(tmp_path):
    run = [sys.executable, "-m", "ssdtrain_megatron.megatron.args"]
    out = subprocess.run(run + [os.path.join(REPO, "configs", "gpt3-1.3b.yaml")],
                         capture_output=True, text=True)
    assert out.returncode == 0
    assert out.stdout.startswith("--num-layers 24 --hidden-size 2048 ")
    assert out.stdout.count("\n") == 1
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: 2\n")
    out = subprocess.run(run + [str(bad)], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip() == (f"python -m ssdtrain_megatron.megatron.args: error: {bad}: "
                                  "model: missing key(s) hidden, heads, ffn_hidden, seq_len, "
                                  "micro_batch")


def test_verify_is_a_choice_flag_and_the_old_checksum_switch_is_its_deprecated_alias(capsys, caplog):
    """``--ssd-offload-verify {off,crc32c}`` is the documented flag; ``--ssd-offload-checksum`` /
    ``--no-ssd-offload-checksum`` still work, set the same field, are hidden from --help, and
    log one warning naming the new flag. Break: drop the deprecated_switch of ``verify`` in
    config.py -> 'unrecognized arguments: --ssd-offload-checksum'."""
    from ssdtrain_megatron.config_checks import warn_deprecated

    warn_deprecated.cache_clear()
    with caplog.at_level(logging.WARNING, logger="ssdtrain_megatron.config"):
        on = _parser().parse_args(["--ssd-offload", "--ssd-offload-checksum"])
        off = _parser().parse_args(["--ssd-offload", "--no-ssd-offload-checksum"])
        again = _parser().parse_args(["--ssd-offload", "--ssd-offload-checksum"])
    assert config_from_args(on).verify == "crc32c" == config_from_args(again).verify
    assert config_from_args(off).verify == "off"
    assert explicit_fields(on) == {"verify": "crc32c"} and given_flags(off) == ["--ssd-offload-verify"]
    said = [r.getMessage() for r in caplog.records]
    assert said == ["ssdtrain: --ssd-offload-checksum is deprecated and will be removed; use "
                    "--ssd-offload-verify crc32c",
                    "ssdtrain: --no-ssd-offload-checksum is deprecated and will be removed; use "
                    "--ssd-offload-verify off"], said  # once each, not once per parse
    assert config_from_args(_parser().parse_args(["--ssd-offload-verify", "crc32c"])).verify == "crc32c"
    assert "'sha256' is invalid" in _fails(["--ssd-offload-verify", "sha256"], capsys)
    _parser().print_help()
    text = capsys.readouterr().out
    assert "--ssd-offload-verify {off,crc32c}" in text and "-checksum" not in text
