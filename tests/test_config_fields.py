"""Each OffloadConfig field carries its own check, flag and help (``knob()`` metadata), so the
flags are built from the fields alone; ConfigError says what is wrong through attributes."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from typing import List, Optional

import pytest

from ssdtrain_megatron.config import ConfigError, OffloadConfig
from ssdtrain_megatron.config_checks import int_at_least, knob, layer_numbers
from ssdtrain_megatron.megatron import args as args_mod
from ssdtrain_megatron.megatron import flag_values
from ssdtrain_megatron.megatron.args import add_ssd_offload_args, config_from_args, flag_for


@dataclass
class ExtendedConfig(OffloadConfig):
    """OffloadConfig with fields that args.py has never heard of."""

    spill_layers: List[int] = knob(default_factory=list, check=layer_numbers,
                                   help="Layers spilled to the second tier")
    """A list field: comma-separated numbers and ranges."""

    scratch_bytes: Optional[int] = knob(None, check=int_at_least(4096, optional=True), unit="bytes",
                                        help="Scratch space per rank", deprecated_flags=["--ssd-scratch"])
    """A size with units, an old flag name kept."""

    tag: str = knob("x", check=lambda name, value: value, flag="--ssd-offload-label",
                    help="A free-form label")
    """A field whose flag is not the default name."""


@pytest.fixture
def extended(monkeypatch):
    monkeypatch.setattr(args_mod, "OffloadConfig", ExtendedConfig)
    monkeypatch.setattr(flag_values, "OffloadConfig", ExtendedConfig)
    return add_ssd_offload_args(argparse.ArgumentParser(prog="train.py"))


def test_a_new_field_gets_its_flag_help_parser_and_check_from_its_declaration(extended, capsys):
    help_text = " ".join(extended.format_help().split())
    assert "--ssd-offload-spill-layers N[,N...] Layers spilled to the second tier (default: none)" in help_text
    assert "--ssd-offload-scratch-bytes BYTES Scratch space per rank (default: unset)" in help_text
    assert "--ssd-offload-label VALUE A free-form label (default: x)" in help_text
    assert "--ssd-scratch" not in help_text  # deprecated names work but are not advertised
    args = extended.parse_args(["--ssd-offload", "--ssd-offload-spill-layers", "1,3-4",
                                "--ssd-offload-scratch-bytes", "1MiB", "--ssd-offload-label", "run7"])
    cfg = config_from_args(args)
    assert isinstance(cfg, ExtendedConfig)
    assert (cfg.spill_layers, cfg.scratch_bytes, cfg.tag) == ([1, 3, 4], 1 << 20, "run7")
    with pytest.raises(SystemExit):
        extended.parse_args(["--ssd-offload-scratch-bytes", "100"])
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "train.py: error: argument --ssd-offload-scratch-bytes: 100 is invalid: "
        "expected an integer >= 4096 or null")


def test_a_deprecated_flag_name_still_sets_its_field_and_warns(extended):
    with pytest.warns(FutureWarning, match="--ssd-scratch is deprecated; use --ssd-offload-scratch-bytes"):
        args = extended.parse_args(["--ssd-offload", "--ssd-scratch", "8KiB"])
    assert config_from_args(args).scratch_bytes == 8192


def test_every_flag_shows_its_fields_own_help():
    help_text = " ".join(add_ssd_offload_args(argparse.ArgumentParser()).format_help().split())
    for f in dataclasses.fields(OffloadConfig):
        assert f.metadata["help"], f.name
        assert " ".join(f.metadata["help"].split()) in help_text.replace("%%", "%"), f.name
        assert flag_for(f.name) in help_text


def test_fields_are_typed_with_their_item_types():
    hints = typing.get_type_hints(OffloadConfig)
    assert hints["dirs"] == List[str] and hints["recompute_layers"] == List[int]
    for f in dataclasses.fields(OffloadConfig):
        assert hints[f.name] not in (list, dict, typing.Any), f.name


def test_config_error_carries_field_value_and_allowed():
    with pytest.raises(ConfigError) as err:
        OffloadConfig(io_threads=0)
    e = err.value
    assert (e.field, e.value, e.allowed) == ("io_threads", 0, "expected an integer >= 1")
    assert e.reason == "0 is invalid: expected an integer >= 1"
    assert str(e) == "OffloadConfig.io_threads=0 is invalid: expected an integer >= 1"
    with pytest.raises(ConfigError) as err:
        OffloadConfig(dirs=["/ok", "/mnt/{drive}"])
    e = err.value
    assert (e.field, e.value) == ("dirs", "/mnt/{drive}")
    assert str(e).startswith("OffloadConfig.dirs[1]='/mnt/{drive}' is invalid: unknown placeholder")
    with pytest.raises(ConfigError) as err:  # a rule between two fields names the one to change
        OffloadConfig(engine="memory", verify="crc32c", host_memory_bytes=1 << 20)
    assert (err.value.field, err.value.value) == ("verify", "crc32c")
    assert "engine='tiered'" in err.value.allowed


def test_unknown_keys_are_a_config_error_without_a_field():
    with pytest.raises(ConfigError) as err:
        OffloadConfig.from_dict({"drives": 3}, source="p.yaml")
    assert err.value.field is None and "dirs" in err.value.allowed
    assert err.value.reason == str(err.value) == (
        "p.yaml: unknown key(s) drives; allowed: " + ", ".join(OffloadConfig.field_names()))


def test_checks_normalise_what_they_accept():
    cfg = OffloadConfig(dirs=("/a", "/b"), recompute_layers=(2, 3), io_timeout_s=5)
    assert cfg.dirs == ["/a", "/b"] and cfg.recompute_layers == [2, 3]
    assert isinstance(cfg.io_timeout_s, float) and cfg.io_timeout_s == 5.0
