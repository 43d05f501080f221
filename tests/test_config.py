"""OffloadConfig: defaults, YAML in and out, and one named error per invalid field."""

import pytest

from ssdtrain_megatron.config import ConfigError, OffloadConfig


def test_defaults_are_valid_and_documented():
    cfg = OffloadConfig()
    assert cfg.engine == "posix" and cfg.policy == "offload"
    import ast
    import inspect

    import ssdtrain_megatron.config as mod

    # Every field has a docstring right under it (the style of megatron's TransformerConfig).
    tree = ast.parse(inspect.getsource(mod))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "OffloadConfig")
    body = cls.body
    documented = {body[i].target.id for i in range(len(body) - 1)
                  if isinstance(body[i], ast.AnnAssign) and isinstance(body[i + 1], ast.Expr)
                  and isinstance(body[i + 1].value, ast.Constant)}
    assert documented >= set(OffloadConfig.field_names())


@pytest.mark.parametrize("field,value,message", [
    ("dirs", [], "non-empty list"),
    ("dirs", "/mnt/nvme0", "list of path templates"),
    ("dirs", [""], "non-empty path"),
    ("dirs", ["/mnt/{node}"], "unknown placeholder {node}"),
    ("dirs", ["/mnt/nvme0/../etc"], "'..' is not allowed"),
    ("dirs", ["/mnt/{rank"], "not a valid path template"),
    ("engine", "nvme", "allowed: posix"),
    ("policy", "always", "allowed: offload, adaptive, keep"),
    ("min_tensor_bytes", -1, "integer >= 0"),
    ("min_tensor_bytes", 1.5, "integer >= 0"),
    ("keep_last_layers", True, "integer >= 0"),
    ("prefetch_layers", 0, "integer >= 1"),
    ("max_inflight_bytes", 0, "integer >= 1"),
    ("verify", "md5", "allowed: off, crc32c"),
    ("checksum", "yes", "true or false"),
    ("stats_path", "", "file path or null"),
    ("io_threads", 0, "integer >= 1"),
    ("chunk_bytes", 1000, "integer >= 4096"),
    ("chunk_bytes", 4097, "multiple of 4096"),
    ("io_timeout_s", 0, "seconds > 0"),
    ("job", "a/b", "without '/'"),
])
def test_every_invalid_field_raises_its_named_error(field, value, message):
    with pytest.raises(ConfigError) as err:
        OffloadConfig(**{field: value})
    text = str(err.value)
    assert text.startswith(f"OffloadConfig.{field.split('[')[0]}") or text.startswith("OffloadConfig.dirs[")
    assert repr(value) in text or (isinstance(value, list) and value and repr(value[0]) in text)
    assert message in text
    assert "\n" not in text


def test_yaml_round_trip(tmp_path):
    cfg = OffloadConfig(dirs=["/mnt/nvme{local_rank}/act/{job}"], policy="keep", verify="crc32c",
                        min_tensor_bytes=0, stats_path="/tmp/s.jsonl")
    path = tmp_path / "c.yaml"
    path.write_text(cfg.to_yaml())
    assert OffloadConfig.from_yaml(str(path)) == cfg


def test_yaml_offload_section_is_read(tmp_path):
    path = tmp_path / "preset.yaml"
    path.write_text("model:\n  hidden: 64\noffload:\n  policy: keep\n  keep_last_layers: 2\n")
    cfg = OffloadConfig.from_yaml(str(path))
    assert cfg.policy == "keep" and cfg.keep_last_layers == 2


def test_unknown_yaml_key_is_an_error(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("policy: offload\nprefetch_layer: 3\n")
    with pytest.raises(ConfigError, match=r"c.yaml: unknown key\(s\) prefetch_layer; allowed: dirs"):
        OffloadConfig.from_yaml(str(path))


def test_yaml_bad_value_names_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("policy: sometimes\n")
    with pytest.raises(ConfigError, match=r"OffloadConfig.policy='sometimes' is invalid"):
        OffloadConfig.from_yaml(str(path))


def test_the_deprecated_checksum_key_sets_verify_and_says_so_once(tmp_path, caplog):
    """YAML presets and Python code written for ``checksum: true`` keep working: the key sets
    ``verify`` (true: crc32c, false: off), logs one warning naming ``verify``, is not written
    back (to_dict has ``verify`` only), and may not contradict an explicit ``verify``.
    Break: drop "checksum" from DEPRECATED_KEYS in config.py -> 'unknown key(s) checksum'."""
    import logging

    from ssdtrain_megatron.config_checks import warn_deprecated

    warn_deprecated.cache_clear()
    path = tmp_path / "old.yaml"
    path.write_text("offload:\n  checksum: true\n  io_threads: 2\n")
    with caplog.at_level(logging.WARNING, logger="ssdtrain_megatron.config"):
        cfg = OffloadConfig.from_yaml(str(path))
        assert OffloadConfig(checksum=False).verify == "off"
        assert OffloadConfig.from_dict({"checksum": True}).verify == "crc32c"
    assert cfg.verify == "crc32c" and cfg == OffloadConfig(verify="crc32c", io_threads=2)
    assert "checksum" not in cfg.to_dict() and cfg.to_dict()["verify"] == "crc32c"
    assert cfg.replace(io_threads=3).verify == "crc32c"  # replace keeps it without the old key
    assert [r.getMessage() for r in caplog.records] == [
        "ssdtrain: OffloadConfig key 'checksum' is deprecated and will be removed; use verify: "
        "crc32c (or off; flag --ssd-offload-verify)"]
    with pytest.raises(ConfigError) as err:
        OffloadConfig(verify="crc32c", checksum=False)
    assert (err.value.field, err.value.value) == ("checksum", False)
    assert "contradicts verify='crc32c'" in str(err.value)


def test_verify_off_unquoted_in_yaml_is_off_not_an_error(tmp_path):
    """YAML 1.1 reads ``verify: off`` as false (and ``on`` as true): the preset a user writes
    the natural way must load. Break: check verify with one_of(VERIFY) in config.py ->
    "OffloadConfig.verify=False is invalid"."""
    path = tmp_path / "p.yaml"
    path.write_text("offload:\n  verify: off\n")
    assert OffloadConfig.from_yaml(str(path)).verify == "off"
    path.write_text("offload:\n  verify: on\n")
    assert OffloadConfig.from_yaml(str(path)).verify == "crc32c"
    path.write_text("offload:\n  verify: crc32c\n")
    assert OffloadConfig.from_yaml(str(path)).verify == "crc32c"


def test_min_tensor_bytes_defaults_by_device_and_a_set_value_wins():
    """On a CUDA device each offloaded record costs a copy launch each way and host work
    whatever its size: the default threshold there is 1 MiB (RoPE's 256 KiB tables stay);
    elsewhere 256 KiB, as before."""
    import torch

    cfg = OffloadConfig()
    assert cfg.min_tensor_bytes is None
    assert cfg.min_bytes_for(torch.device("cuda", 0)) == 1 << 20 and cfg.min_bytes_for("cuda") == 1 << 20
    assert cfg.min_bytes_for(torch.device("cpu")) == 256 * 1024
    assert OffloadConfig(min_tensor_bytes=4096).min_bytes_for("cuda") == 4096
    assert OffloadConfig.from_dict({"min_tensor_bytes": None}).min_tensor_bytes is None
