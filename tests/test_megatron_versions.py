"""What differs between megatron-core 0.16-0.20, checked against the megatron-core installed here,
and a newer minor release run at the user's word (--ssd-offload-allow-untested-megatron).

Run by the default suite (megatron-core 0.16.1), by ``make test-mcore-0.17`` / ``-0.18`` /
``-0.19`` in a virtualenv of that release, and by ``make test-megatron-main`` with a Megatron-LM
main checkout's ``megatron/core`` imported first (0.20): every test reads the release table of
``ssdtrain_megatron.megatron.compat`` and checks it against the real package.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

pytest.importorskip("megatron.core")

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning:megatron.*"),
              pytest.mark.filterwarnings("ignore::UserWarning:megatron.*")]

from ssdtrain_megatron import OffloadConfig  # noqa: E402
from ssdtrain_megatron import megatron as integration  # noqa: E402
from ssdtrain_megatron.megatron import compat, patch_points  # noqa: E402
from ssdtrain_megatron.megatron.launch import LaunchError, install_from_args  # noqa: E402
from ssdtrain_megatron.megatron.scopes import LayerScopes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))  # megatron_harness and its helpers


def _release() -> compat.Release:
    return compat.release_for(compat.megatron_core_version())


def test_the_release_table_matches_the_installed_megatron_core():
    release = _release()
    patch_points.verify(release, compat.megatron_core_version())  # raises on any difference
    from megatron.core.pipeline_parallel import schedules

    owner, name, is_method = compat.recompute_patch_point(release)
    assert callable(vars(owner)[name])
    assert is_method == isinstance(owner, type)
    # Nothing the table does not know: 0.16 has no multi-module backward, 0.17+ have it.
    assert ("backward_step_multimodule" in vars(schedules)) == \
        ("backward_step_multimodule" in release.backward_steps)
    # 0.18+ dropped the block method for the free function.
    from megatron.core.transformer.transformer_block import TransformerBlock

    assert ("_checkpointed_forward" in vars(TransformerBlock)) == release.recompute_is_method
    assert (importlib.util.find_spec("megatron.training") is not None) == release.ships_training


def test_rope_reaches_a_full_recompute_checkpoint_as_the_table_says():
    """0.19 passes RoPE to ``tensor_parallel.checkpoint`` as two tensors, earlier releases as
    one: count the checkpoint's inputs of a real full-recompute block forward (CPU)."""
    from megatron.core.tensor_parallel import random as tp_random

    release = _release()
    owner, name, is_method = compat.recompute_patch_point(release)
    driver = vars(owner)[name]
    seen = []

    def checkpoint(function, distribute, *args):
        seen.append(args)
        return function(*args)

    block = types.SimpleNamespace(
        config=types.SimpleNamespace(recompute_method="uniform", recompute_num_layers=1, fp8=None,
                                     fp4=None, distribute_saved_activations=False),
        num_layers_per_pipeline_rank=1, layers=[_IdentityLayer()])
    block._get_layer = lambda i: block.layers[i]
    hidden, rope = torch.ones(2, 1, 4), torch.zeros(2, 1, 1, 4)
    original = tp_random.checkpoint
    from megatron.core import tensor_parallel

    tensor_parallel.checkpoint = tp_random.checkpoint = checkpoint
    try:
        kwargs = dict(hidden_states=hidden, attention_mask=None, context=None, context_mask=None,
                      rotary_pos_emb=rope, attention_bias=None, packed_seq_params=None,
                      use_inner_quantization_context=False)
        driver(block, **_accepted(driver, kwargs))
    finally:
        tensor_parallel.checkpoint = tp_random.checkpoint = original
    assert len(seen) == 1
    positions = [i for i, a in enumerate(seen[0]) if a is rope]
    # (hidden_states, attention_mask, context, context_mask, <RoPE: 1 or 2 slots>, ...): a
    # single RoPE tensor takes the global (last) slot.
    assert positions == [4 + release.rope_tensors_at_checkpoint - 1], [type(a) for a in seen[0]]


class _IdentityLayer(torch.nn.Module):
    layer_number = 1

    def forward(self, hidden_states, context=None, **kwargs):
        return hidden_states, context


def _accepted(fn, kwargs):
    import inspect

    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def test_install_refuses_a_release_whose_patch_points_moved(tmp_path, monkeypatch):
    """A patch release that changed ``backward_step``'s parameters is refused before anything
    is patched, naming the function and both parameter lists."""
    from megatron.core.pipeline_parallel import schedules

    def backward_step(input_tensor, output_tensor, grad, config, extra):  # moved parameters
        raise AssertionError("never called")

    before = dict(vars(schedules))
    monkeypatch.setitem(vars(schedules), "backward_step", backward_step)
    with pytest.raises(integration.UnsupportedMegatronVersion,
                       match=r"schedules\.backward_step\(.*extra.*\) \(expected") as err:
        integration.install(OffloadConfig(dirs=[str(tmp_path / "never")]))
    assert compat.megatron_core_version() in str(err.value)
    assert integration.installed() is None
    assert vars(schedules)["forward_step"] is before["forward_step"]
    assert not (tmp_path / "never").exists()


def test_megatron_core_version_reports_the_package_that_is_imported(tmp_path):
    """A checkout earlier on sys.path wins over the installed wheel for ``import megatron``,
    so it is the version that counts, not the wheel's metadata."""
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("raise ImportError('a checkout that does not import')\n")
    (core / "package_info.py").write_text(
        "MAJOR = 0\nMINOR = 18\nPATCH = 7\nPRE_RELEASE = 'rc2'\n"
        "raise RuntimeError('package_info is read, not executed')\n")
    code = textwrap.dedent("""
        from importlib import metadata
        from ssdtrain_megatron.megatron import compat
        print(compat.megatron_core_version())
        print(metadata.version("megatron-core"))
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=str(tmp_path),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert out.returncode == 0, out.stdout
    imported, wheel = out.stdout.split()
    assert imported == "0.18.7rc2"
    assert wheel != imported  # the metadata would have said the wheel's version


def test_megatron_core_version_of_this_process_is_the_imported_package():
    import megatron.core

    folder = os.path.dirname(megatron.core.__file__)
    assert compat.megatron_core_version() == \
        compat._version_from_package_info(os.path.join(folder, "package_info.py"))


# -- megatron-core's own activation offloading -----------------------------------------------


@pytest.mark.parametrize("setting,flag", [
    ({"fine_grained_activation_offloading": True}, "--fine-grained-activation-offloading"),
    ({"cpu_offloading": True, "cpu_offloading_num_layers": 2}, "--cpu-offloading-num-layers"),
])
def test_a_step_with_megatrons_own_offloading_is_refused_before_it_runs(setting, flag, tmp_path):
    """Both of megatron-core's offloads install saved-tensor hooks of their own: the offloaded
    step refuses, naming the setting and the flag, and runs nothing."""
    model = torch.nn.Linear(2, 2)
    model.config = types.SimpleNamespace(**setting)
    ran = []
    integration.install(OffloadConfig(dirs=[str(tmp_path)], min_tensor_bytes=0))
    try:
        from megatron.core.pipeline_parallel import get_forward_backward_func  # the patched one

        fb = get_forward_backward_func(pp_size=1, vp_size=None)  # no process groups here
        with pytest.raises(ValueError, match=rf"turn off {next(iter(setting))} \({flag}\)"):
            fb(forward_step_func=lambda *a: ran.append(a), data_iterator=None, model=model,
               num_microbatches=1, seq_length=1, micro_batch_size=1)
        assert ran == []
    finally:
        integration.uninstall()


def test_the_launcher_refuses_megatrons_own_offloading_with_one_line(tmp_path):
    args = argparse.Namespace(ssd_offload=True, ssd_offload_dir=[str(tmp_path)],
                              fine_grained_activation_offloading=True, cpu_offloading=False,
                              cpu_offloading_num_layers=0)
    with pytest.raises(LaunchError) as err:
        install_from_args(args)
    assert str(err.value).count("\n") == 0
    assert "remove --fine-grained-activation-offloading" in str(err.value)
    assert integration.installed() is None
    assert os.listdir(tmp_path) == []


def test_megatrons_offloading_settings_off_are_not_a_conflict():
    off = types.SimpleNamespace(cpu_offloading=False, cpu_offloading_num_layers=0,
                                fine_grained_activation_offloading=False)
    assert compat.megatron_offloading_in_use(off) == []
    assert compat.megatron_offloading_in_use(argparse.Namespace()) == []


# -- recompute fallback: tensors inside tuples (0.19's dual RoPE) ------------------------------


def test_fallback_checkpoint_passes_tensors_inside_tuples_as_inputs():
    """CheckpointFunction saves positional tensors only: a tuple of two RoPE tensors must
    reach it as two inputs (saved, offloaded, given gradients), and the layer must get the
    tuple back, with the tensors checkpoint handed to the run function."""
    received = []

    def checkpoint(run, distribute, *tensors):
        received.append(tensors)
        return run(*[t.detach().clone() for t in tensors])

    calls = []

    def layer_forward(layer, hidden_states, rotary_pos_emb=None, attention_mask=None):
        calls.append((hidden_states, rotary_pos_emb, attention_mask))
        return hidden_states

    scopes = LayerScopes(offloader=None, recompute_layers=frozenset(),
                         layer_forward=layer_forward, block_checkpointed_forward=None,
                         checkpoint=checkpoint)
    hidden, local, global_ = torch.ones(2), torch.full((2,), 2.0), torch.full((2,), 3.0)
    scopes._checkpointed_layer(object(), (hidden,), {"rotary_pos_emb": (local, global_),
                                                     "attention_mask": None})
    (tensors,) = received
    assert [t is x for t, x in zip(tensors, (hidden, local, global_))] == [True] * 3
    (h, rope, mask), = calls
    assert isinstance(rope, tuple) and len(rope) == 2 and mask is None
    assert torch.equal(rope[0], local) and torch.equal(rope[1], global_)
    assert rope[0] is not local  # the run function got checkpoint's tensors, not the originals


# -- a minor release newer than the table, at the user's word ----------------------------------

_ALLOW = "--ssd-offload-allow-untested-megatron"


def _installed_minor() -> tuple:
    return compat._minor_key(compat.megatron_core_version())


@pytest.fixture
def newer_than_table(monkeypatch):
    """The release table cut after the installed megatron-core's minor release, and the
    version lookup faked to say the next minor: a release newer than any known whose real
    patch points are those of the newest known one. Returns the faked version."""
    major, minor = _installed_minor()
    table = {k: r for k, r in compat.RELEASES.items()
             if compat._minor_key(k) <= (major, minor)}
    monkeypatch.setattr(compat, "RELEASES", table)
    fake = f"{major}.{minor + 1}.0"
    install_module = importlib.import_module("ssdtrain_megatron.megatron.install")
    monkeypatch.setattr(install_module, "megatron_core_version", lambda: fake)
    return fake


def _untested_warnings(caplog, version: str) -> list:
    return [r for r in caplog.records if r.levelname == "WARNING" and version in r.getMessage()
            and "newer than any release tested" in r.getMessage()]


def test_a_newer_minor_is_refused_in_one_line_that_names_the_flag(newer_than_table, tmp_path):
    with pytest.raises(integration.UnsupportedMegatronVersion) as err:
        integration.install(OffloadConfig(dirs=[str(tmp_path / "never")]))
    message = str(err.value)
    assert "\n" not in message
    assert newer_than_table in message and _ALLOW in message
    assert "allow_untested_megatron: true" in message
    assert integration.installed() is None
    assert not (tmp_path / "never").exists()


def test_a_newer_minor_trains_with_the_flag_and_one_warning(newer_than_table, tmp_path, caplog):
    """With the flag the faked newer release installs with the newest known release's patch
    points (the installed megatron-core's, checked first), trains bitwise equal to training
    without offload, and says once what it assumed."""
    import megatron_harness as harness
    from megatron_harness import LayoutSpec, Phase

    offload = dict(dirs=["{root}/a"], policy="offload", min_tensor_bytes=0,
                   allow_untested_megatron=True)
    spec = LayoutSpec(iterations=1, phases=[Phase("plain"), Phase("offload", offload=offload)])
    caplog.set_level("WARNING", logger="ssdtrain_megatron")
    (r,) = harness.run_layout(spec, str(tmp_path))
    assert harness.phase_differences(r.phases["plain"], r.phases["offload"]) == []
    assert all(s["bytes_offloaded"] > 0 for s in r.phases["offload"].offload["steps"])
    (warning,) = _untested_warnings(caplog, newer_than_table)
    major, minor = _installed_minor()
    assert f"patch points of megatron-core {major}.{minor}.x" in warning.getMessage()
    assert "\n" not in warning.getMessage()
    assert integration.installed() is None


def _backward_step_with_other_parameters(input_tensor, output_tensor, grad, config, extra):
    raise AssertionError("never called")


def _checkpoint_with_other_parameters(function, *args):
    raise AssertionError("never called")


def _forward_step_without_vp_stage(forward_step_func, data_iterator, model, num_microbatches,
                                   input_tensor, current_microbatch=None):
    raise AssertionError("never called")


@pytest.mark.parametrize("module,name,replacement,named", [
    ("megatron.core.pipeline_parallel.schedules", "backward_step", None,
     "schedules.backward_step is missing"),
    ("megatron.core.pipeline_parallel.schedules", "backward_step",
     _backward_step_with_other_parameters, "schedules.backward_step("),
    ("megatron.core.pipeline_parallel.schedules", "forward_step", _forward_step_without_vp_stage,
     "expected parameters vp_stage"),
    ("megatron.core.tensor_parallel.random", "checkpoint", _checkpoint_with_other_parameters,
     "tensor_parallel.random.checkpoint("),
    ("megatron.core.pipeline_parallel.schedules", "forward_backward_pipelining_with_interleaving",
     None, "schedules.forward_backward_pipelining_with_interleaving is missing"),
])
def test_a_missing_or_changed_patch_point_is_refused_even_with_the_flag(
        newer_than_table, module, name, replacement, named, tmp_path, monkeypatch, caplog):
    owner = importlib.import_module(module)
    if replacement is None:
        monkeypatch.delattr(owner, name)
    else:
        monkeypatch.setattr(owner, name, replacement)
    with pytest.raises(integration.UnsupportedMegatronVersion) as err:
        integration.install(OffloadConfig(dirs=[str(tmp_path / "never")],
                                          allow_untested_megatron=True))
    assert named in str(err.value) and newer_than_table in str(err.value)
    assert "\n" not in str(err.value)
    assert _untested_warnings(caplog, newer_than_table) == []
    assert integration.installed() is None
    assert not (tmp_path / "never").exists()


def test_a_missing_recompute_driver_is_refused_even_with_the_flag(newer_than_table, tmp_path,
                                                                   monkeypatch):
    owner, name, _ = compat.recompute_patch_point(compat.newest_release())
    monkeypatch.delattr(owner, name)
    with pytest.raises(integration.UnsupportedMegatronVersion, match=rf"{name} is missing"):
        integration.install(OffloadConfig(dirs=[str(tmp_path / "never")],
                                          allow_untested_megatron=True))
    assert integration.installed() is None


@pytest.mark.parametrize("version,allowed", [("0.21.0", "0.20"), ("1.0.0rc1", "0.20"),
                                             ("0.15.3", None), ("0.12.0", None)])
def test_only_a_newer_minor_is_allowed_and_only_with_the_flag(version, allowed):
    if allowed is None:  # older: the flag does not help
        with pytest.raises(integration.UnsupportedMegatronVersion, match="not supported"):
            compat.release_for(version, allow_untested=True)
        return
    assert compat.release_for(version, allow_untested=True).minor == allowed
    with pytest.raises(integration.UnsupportedMegatronVersion, match=_ALLOW):
        compat.release_for(version)
    assert compat.is_untested(version)
    assert not compat.is_untested("0.20.0") and not compat.is_untested("0.19.2")


def test_the_flag_and_the_yaml_key_set_allow_untested_megatron(tmp_path):
    from ssdtrain_megatron.megatron.args import add_ssd_offload_args, config_from_args

    parser = add_ssd_offload_args(argparse.ArgumentParser())
    assert config_from_args(parser.parse_args(["--ssd-offload", _ALLOW])).allow_untested_megatron
    assert not config_from_args(parser.parse_args(["--ssd-offload"])).allow_untested_megatron
    preset = tmp_path / "p.yaml"
    preset.write_text("offload:\n  allow_untested_megatron: true\n")
    assert OffloadConfig.from_yaml(str(preset)).allow_untested_megatron
    preset.write_text("offload:\n  allow_untested_megatron: maybe\n")
    with pytest.raises(Exception, match="allow_untested_megatron"):
        OffloadConfig.from_yaml(str(preset))
