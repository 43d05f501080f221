"""Node profiles (plan/node.py): the built-ins, the per-GPU figures derived from them, YAML in
and out, and one-line errors that name the field. Pure Python; real files in tmp_path."""

from __future__ import annotations

import pytest

from ssdtrain_megatron.plan.node import (BUILTIN, NodeProfile, ProfileError, load_profile,
                                         profile_from_preset)
from ssdtrain_megatron.sizes import parse_size_with_unit


def test_the_named_profiles_exist_and_are_valid():
    assert {"a100-80g", "dgx-h100", "dgx-h200", "dgx-b200", "gh200", "cloud-h100"} <= set(BUILTIN)
    for name, node in BUILTIN.items():
        assert node.name == name and node.source
        assert NodeProfile(**node.to_dict()) == node


def test_per_gpu_drive_bandwidth_is_the_nodes_drives_shared_by_its_gpus():
    node = load_profile("dgx-h100")
    assert node.ssd_write_gbps == 8 * node.drive_write_gbps / 8
    fewer = load_profile("cloud-h100")
    assert fewer.drives < node.drives
    assert fewer.ssd_write_gbps == fewer.drives * fewer.drive_write_gbps / fewer.gpus_per_node
    assert fewer.ssd_read_gbps == fewer.drives * fewer.drive_read_gbps / 8


def test_a_profile_saved_as_yaml_loads_back_equal(tmp_path):
    path = tmp_path / "node.yaml"
    node = load_profile("gh200").replace(name="mine", source="measured 2025-01-01")
    node.save(str(path))
    assert load_profile(str(path)) == node
    assert NodeProfile.from_dict(node.to_dict()) == node


def test_base_and_overrides_and_sizes_with_units(tmp_path):
    node = NodeProfile.from_dict({"base": "dgx-h100", "name": "small", "drives": 2,
                                  "host_memory_bytes": "64GiB"})
    assert (node.name, node.drives, node.host_memory_bytes) == ("small", 2, 64 << 30)
    assert node.gpu_tflops == BUILTIN["dgx-h100"].gpu_tflops


@pytest.mark.parametrize("changes, message", [
    ({"host_link_gbps": -1}, "node.host_link_gbps=-1 is invalid: expected a number > 0"),
    ({"drives": 1.5}, "node.drives=1.5 is invalid: expected an integer >= 0"),
    ({"gpu_memory_bytes": 80}, "node.gpu_memory_bytes=80 is invalid: expected bytes >= 1MiB"),
    ({"gpu_memory_bytes": "80"}, "node.gpu_memory_bytes: 80: give a unit, e.g. 80GB"),
    ({"gpus_per_node": True}, "node.gpus_per_node=True is invalid"),
    ({"drive_write_gbps": 0}, "node.drive_write_gbps=0 is invalid: expected a number > 0"),
    ({"colour": "green"}, "node: unknown key(s) colour; allowed: name, gpus_per_node"),
])
def test_a_bad_field_is_one_line_that_names_it(changes, message):
    with pytest.raises(ProfileError) as info:
        NodeProfile.from_dict({"base": "dgx-h100", **changes})
    assert message in str(info.value) and "\n" not in str(info.value)


def test_no_drives_means_no_ssd_tier_and_zero_drive_figures_are_allowed():
    node = NodeProfile.from_dict({"base": "dgx-h100", "drives": 0, "drive_write_gbps": 0,
                                  "drive_read_gbps": 0, "drive_tbw_tb": 0})
    assert node.ssd_write_gbps == 0 and node.ssd_read_gbps == 0


def test_missing_fields_and_unknown_names_say_what_exists(tmp_path):
    with pytest.raises(ProfileError, match="missing key.*gpus_per_node.*dgx-h100"):
        NodeProfile.from_dict({"name": "x"})
    with pytest.raises(ProfileError, match="'dgx-h900' is neither a built-in node profile "
                                           r"\(a100-80g, dgx-h100"):
        load_profile("dgx-h900")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(str(bad))


def test_a_presets_node_section_takes_a_name_or_a_mapping():
    assert profile_from_preset("dgx-b200") is BUILTIN["dgx-b200"]
    node = profile_from_preset({"base": "a100-80g", "drives": 4}, source="x.yaml: node")
    assert node.drives == 4
    with pytest.raises(ProfileError, match="x.yaml: node.drives=-4 is invalid"):
        profile_from_preset({"base": "a100-80g", "drives": -4}, source="x.yaml: node")
    with pytest.raises(ProfileError, match="^node: 'nope' is neither"):
        profile_from_preset("nope")


def test_a_size_without_a_unit_is_refused_in_one_line():
    assert parse_size_with_unit("80GB") == 80 * 10 ** 9
    assert parse_size_with_unit("1.5GiB") == 3 << 29
    assert parse_size_with_unit("4096B") == 4096
    for text in ("80", " 80 ", "80.5"):
        with pytest.raises(ValueError) as info:
            parse_size_with_unit(text)
        assert str(info.value) == f"{text.strip()}: give a unit, e.g. {text.strip()}GB"
    with pytest.raises(ValueError, match="'80 parsecs' is not a size with a unit"):
        parse_size_with_unit("80 parsecs")
