"""Capability checks live where an engine is built, never in the config: every preset loads
on a machine without CUDA (a login node), and an engine that cannot run here fails, with the
reason, only when it is constructed (as DeepSpeed's op builders check ``is_compatible``)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest
import torch
import yaml

from ssdtrain_megatron.config import OffloadConfig
from ssdtrain_megatron.io import EngineUnavailable, engine_class, make_engine
from ssdtrain_megatron.megatron.args import add_ssd_offload_args, config_from_args

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
PRESETS = sorted(f for f in os.listdir(CONFIGS) if f.endswith(".yaml"))

no_gds_here = pytest.mark.skipif(engine_class("gds").is_available()[0], reason="gds can run here")


def _gds_preset(tmp_path, name: str) -> str:
    """A copy of preset ``name`` that asks for the gds engine."""
    with open(os.path.join(CONFIGS, name), encoding="utf-8") as fh:
        data = yaml.safe_load(fh)
    data["offload"]["engine"] = "gds"
    data["offload"]["dirs"] = [str(tmp_path / "ssd")]
    path = tmp_path / f"gds-{name}"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return str(path)


def test_configs_holds_presets():
    assert len(PRESETS) >= 2


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_here_and_with_engine_gds(tmp_path, name):
    assert OffloadConfig.from_yaml(os.path.join(CONFIGS, name)).engine in ("posix", "aio", "gds",
                                                                          "memory", "tiered")
    assert OffloadConfig.from_yaml(_gds_preset(tmp_path, name)).engine == "gds"


def test_the_flags_accept_a_gds_preset_anywhere(tmp_path):
    parser = add_ssd_offload_args(argparse.ArgumentParser())
    args = parser.parse_args(["--ssd-offload", "--ssd-offload-config", _gds_preset(tmp_path, PRESETS[0])])
    assert config_from_args(args).engine == "gds"


@no_gds_here
def test_building_a_gds_engine_here_fails_with_the_reason(tmp_path):
    why = engine_class("gds").is_available()[1]
    assert "kvikio" in why and ("CUDA" in why or "pip install" in why)
    cfg = OffloadConfig.from_yaml(_gds_preset(tmp_path, PRESETS[0]))
    with pytest.raises(EngineUnavailable, match=r"engine 'gds' cannot run here: .*kvikio") as info:
        make_engine(cfg)
    assert why in str(info.value)
    from ssdtrain_megatron.io.gds import GdsEngine

    with pytest.raises(EngineUnavailable, match="kvikio"):  # the constructor checks too
        GdsEngine(cfg)
    assert not (tmp_path / "ssd").exists()  # refused before anything touched the disk


@no_gds_here
def test_an_offloader_with_engine_gds_fails_at_construction_with_the_reason(tmp_path):
    from ssdtrain_megatron.cache import ActivationOffloader

    cfg = OffloadConfig(dirs=[str(tmp_path / "ssd")], engine="gds")
    with pytest.raises(EngineUnavailable, match="kvikio"):
        ActivationOffloader(cfg, device=torch.device("cpu"))


def test_loading_the_config_imports_no_engine():
    code = ("import sys; from ssdtrain_megatron.config import OffloadConfig; "
            "OffloadConfig(engine='gds'); "
            "bad = [m for m in sys.modules if m.startswith('ssdtrain_megatron.io') or m == 'torch']; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
