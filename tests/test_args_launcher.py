"""The --ssd-offload flag group, part: the launcher's hooks, on a stand-in Megatron (split out
of tests/test_args.py, which holds the flag group itself and the helpers used here).

On the default suite (megatron-core 0.16, whose wheel has no ``megatron.training``) the hooks
meet only the stand-in below (``_fake_megatron``), never Megatron-LM's own modules. Those are
met by tests/test_megatron_training_loop.py on the 0.17+ wheels (``make test-mcore-0.17``,
run by .ci/run, which also runs the last test here) and by the opt-in tests against a checkout (``MEGATRON_LM_DIR``). Where
``megatron.training`` is importable, the last test here checks that the stand-in has the shape
of the real modules (the names the launcher patches, the arguments it passes).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
import types

import pytest

from tests.test_args import _parser


# -- the launcher's hooks, on a stand-in Megatron --------------------------------------------


def _fake_megatron(monkeypatch, calls):
    """Modules shaped like megatron.training.{arguments,initialize,global_vars,training}."""
    state = {}

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser()
        parser.add_argument("--num-layers", type=int)
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        state["args"] = parser.parse_args(state["argv"])
        return state["args"]

    def initialize_megatron(extra_args_provider=None, args_defaults={}):
        # As megatron's initialize.py does: the module-level name, looked up at call time.
        sys.modules["megatron.training.initialize"].parse_args(extra_args_provider)
        calls.append("initialized")

    arguments = types.ModuleType("megatron.training.arguments")
    arguments.parse_args = parse_args
    initialize = types.ModuleType("megatron.training.initialize")
    initialize.initialize_megatron = initialize_megatron
    initialize.parse_args = parse_args
    training = types.ModuleType("megatron.training.training")
    training.initialize_megatron = initialize_megatron
    global_vars = types.ModuleType("megatron.training.global_vars")
    global_vars.get_args = lambda: state["args"]
    installer = types.ModuleType("fake_installer")
    installer.installed = lambda: state.get("installed")
    installer.install = lambda config: (calls.append(("install", config)),
                                        state.__setitem__("installed", "OFFLOADER"))[1] or "OFFLOADER"
    installer.uninstall = lambda: (calls.append("uninstall"), state.pop("installed", None))
    for name, module in (("megatron.training.arguments", arguments),
                         ("megatron.training.initialize", initialize),
                         ("megatron.training.training", training),
                         ("megatron.training.global_vars", global_vars),
                         ("fake_installer", installer)):
        monkeypatch.setitem(sys.modules, name, module)
    return state, training, initialize


def test_hooks_add_the_flags_install_after_initialise_and_restore(monkeypatch, tmp_path):
    from ssdtrain_megatron.megatron import launch

    calls = []
    state, training, initialize = _fake_megatron(monkeypatch, calls)
    original = training.initialize_megatron
    target = dataclasses.replace(launch.MEGATRON_LM, installer="fake_installer")
    state["argv"] = ["--num-layers", "2", "--ssd-offload", "--ssd-offload-dir", str(tmp_path)]
    with launch.TrainingHooks(target):
        training.initialize_megatron()  # the name megatron.training.training holds
        assert training.initialize_megatron is not original
    assert calls[0] == "initialized"
    assert calls[1][0] == "install" and calls[1][1].dirs == [str(tmp_path)]
    assert calls[2:] == ["uninstall"]
    assert training.initialize_megatron is original
    assert initialize.initialize_megatron is original


def test_hooks_install_nothing_without_the_flag_and_warn_about_knobs(monkeypatch, caplog):
    from ssdtrain_megatron.megatron import launch

    calls = []
    state, training, _ = _fake_megatron(monkeypatch, calls)
    target = dataclasses.replace(launch.MEGATRON_LM, installer="fake_installer")
    state["argv"] = ["--ssd-offload-io-threads", "2"]
    with caplog.at_level("WARNING"), launch.TrainingHooks(target):
        training.initialize_megatron()
    assert calls == ["initialized"]
    assert "--ssd-offload-io-threads given without --ssd-offload" in caplog.text


def test_install_from_args_is_idempotent(monkeypatch):
    from ssdtrain_megatron.megatron import launch

    calls = []
    state, _, _ = _fake_megatron(monkeypatch, calls)
    target = dataclasses.replace(launch.MEGATRON_LM, installer="fake_installer")
    args = _parser().parse_args(["--ssd-offload", "--ssd-offload-dir", "/tmp/x"])
    assert launch.install_from_args(args, target) == "OFFLOADER"
    assert launch.install_from_args(args, target) == "OFFLOADER"
    assert [c[0] for c in calls] == ["install"]


def test_detect_target_tells_the_layouts_apart(tmp_path):
    from ssdtrain_megatron.megatron import launch

    lm, ds, none = tmp_path / "lm", tmp_path / "ds", tmp_path / "none"
    (lm / "megatron" / "training").mkdir(parents=True)
    (lm / "megatron" / "training" / "initialize.py").write_text("")
    (ds / "megatron").mkdir(parents=True)
    (ds / "megatron" / "initialize.py").write_text("")
    (none / "megatron").mkdir(parents=True)
    assert launch.detect_target([str(lm)]) is launch.MEGATRON_LM
    assert launch.detect_target([str(ds)]) is launch.MEGATRON_DEEPSPEED
    with pytest.raises(launch.LaunchError, match="neither"):
        launch.detect_target([str(none)])
    with pytest.raises(launch.LaunchError, match="no 'megatron' package"):
        launch.detect_target([str(tmp_path)])


def test_launcher_usage_and_missing_script():
    run = [sys.executable, "-m", "ssdtrain_megatron.launch"]
    out = subprocess.run(run, capture_output=True, text=True)
    assert out.returncode == 2 and "-m ssdtrain_megatron.launch SCRIPT" in out.stderr
    out = subprocess.run(run + ["--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "--ssd-offload-dir" in out.stdout
    out = subprocess.run(run + ["/nonexistent/pretrain_gpt.py"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == (
        "ssdtrain-pretrain: error: /nonexistent/pretrain_gpt.py: no such file (expected a "
        "Megatron training script such as Megatron-LM/pretrain_gpt.py)")


def test_launcher_runs_a_script_as_main_with_its_folder_first_on_the_path(tmp_path):
    # A script whose folder has a megatron package of the Megatron-LM layout, stubbed: the
    # launcher wraps its parse_args and initialize_megatron and runs the script as __main__.
    pkg = tmp_path / "megatron" / "training"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "arguments.py").write_text(
        "import argparse, sys\n"
        "def parse_args(extra_args_provider=None, ignore_unknown_args=False):\n"
        "    p = argparse.ArgumentParser()\n"
        "    p.add_argument('--num-layers', type=int)\n"
        "    p = extra_args_provider(p) if extra_args_provider else p\n"
        "    return p.parse_args()\n")
    (pkg / "initialize.py").write_text(
        "from megatron.training.arguments import parse_args\n"
        "ARGS = None\n"
        "def initialize_megatron(extra_args_provider=None):\n"
        "    global ARGS\n"
        "    ARGS = parse_args(extra_args_provider)\n")
    (pkg / "global_vars.py").write_text(
        "def get_args():\n"
        "    from megatron.training import initialize\n"
        "    return initialize.ARGS\n")
    (tmp_path / "helper.py").write_text("VALUE = 'sibling'\n")
    (tmp_path / "train.py").write_text(
        "import helper\n"
        "from megatron.training.initialize import initialize_megatron\n"
        "from megatron.training.global_vars import get_args\n"
        "if __name__ == '__main__':\n"
        "    initialize_megatron()\n"
        "    print('main', helper.VALUE, get_args().num_layers, get_args().ssd_offload)\n")
    out = subprocess.run([sys.executable, "-m", "ssdtrain_megatron.launch",
                          str(tmp_path / "train.py"), "--num-layers", "3"],
                         capture_output=True, text=True, cwd=str(tmp_path.parent))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "main sibling 3 False"
    # A bad value: the pre-flight says it in one line before the script runs; skipped, the
    # script's own parser (which got the flag group) says it.
    bad = [sys.executable, "-m", "ssdtrain_megatron.launch", str(tmp_path / "train.py"),
           "--ssd-offload-io-threads", "0"]
    out = subprocess.run(bad, capture_output=True, text=True, cwd=str(tmp_path.parent))
    assert (out.returncode, out.stdout) == (2, "")
    assert out.stderr.splitlines() == [
        f"ssdtrain-pretrain: error: node {socket.gethostname()}, rank 0 (local rank 0): argument "
        "--ssd-offload-io-threads: 0 is invalid: expected an integer >= 1"]
    out = subprocess.run(bad, capture_output=True, text=True, cwd=str(tmp_path.parent),
                         env=dict(os.environ, SSDTRAIN_SKIP_PREFLIGHT="1"))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].endswith(
        "error: argument --ssd-offload-io-threads: 0 is invalid: expected an integer >= 1")


# What the stand-in provides and the launcher relies on: module -> function -> the parameters
# the launcher's wrappers pass or the stand-in's callers use. The launcher itself needs only
# parse_args(extra_args_provider) and an initialize_megatron to wrap (it passes *args,
# **kwargs through). Up to 0.18, initialize_megatron parses the arguments itself and takes the
# provider (_PARSING_INITIALIZE); megatron-core 0.19 moved the parsing out: its
# initialize_megatron takes neither and initialize.py no longer imports parse_args.
_STAND_IN_SHAPE = {
    "megatron.training.arguments": {"parse_args": ("extra_args_provider", "ignore_unknown_args")},
    "megatron.training.initialize": {"initialize_megatron": ()},
    "megatron.training.training": {"initialize_megatron": ()},
    "megatron.training.global_vars": {"get_args": ()},
}
_PARSING_INITIALIZE = {
    "megatron.training.initialize": {"initialize_megatron": ("extra_args_provider", "args_defaults"),
                                     "parse_args": ("extra_args_provider",)},
    "megatron.training.training": {"initialize_megatron": ("extra_args_provider", "args_defaults")},
}


def test_the_stand_in_has_the_shape_of_the_real_megatron_training(monkeypatch):
    """Broken variant (what a stale stand-in looks like): a parameter the real function lacks,
    e.g. ``"extra_args_providr"`` in _STAND_IN_SHAPE: "megatron.training.arguments.parse_args
    has no parameter 'extra_args_providr'" (on megatron-core 0.17)."""
    import importlib
    import importlib.util
    import inspect

    try:
        found = importlib.util.find_spec("megatron.training") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        pytest.skip("this megatron-core ships no megatron.training (0.16): the tests above meet only "
                    "the stand-in here; run make test-mcore-0.17 to check it against the real modules")
    import typing

    if not hasattr(typing, "override"):  # Python 3.12's; megatron.training 0.18+ imports it
        monkeypatch.setattr(typing, "override", lambda method: method, raising=False)
    shape = {m: dict(f) for m, f in _STAND_IN_SHAPE.items()}
    from megatron.training.initialize import initialize_megatron

    if "extra_args_provider" in inspect.signature(initialize_megatron).parameters:  # up to 0.18
        for module_name, functions in _PARSING_INITIALIZE.items():
            shape[module_name].update(functions)
    for module_name, functions in shape.items():
        module = importlib.import_module(module_name)
        for name, params in functions.items():
            fn = getattr(module, name, None)
            assert callable(fn), f"{module_name} has no {name}(), which the stand-in provides"
            have = inspect.signature(fn).parameters
            for p in params:
                assert p in have, f"{module_name}.{name} has no parameter {p!r}: {list(have)}"
