"""What differs between megatron-core 0.16-0.19, checked against the megatron-core installed here.

Run by the default suite (megatron-core 0.16.1) and by ``make test-mcore-0.17`` / ``-0.18`` /
``-0.19`` in a virtualenv of that release: every test reads the release table of
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
from ssdtrain_megatron.megatron import compat  # noqa: E402
from ssdtrain_megatron.megatron.launch import LaunchError, install_from_args  # noqa: E402
from ssdtrain_megatron.megatron.scopes import LayerScopes  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _release() -> compat.Release:
    return compat.release_for(compat.megatron_core_version())


def test_the_release_table_matches_the_installed_megatron_core():
    release = _release()
    compat.verify(release, compat.megatron_core_version())  # raises on any difference
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
