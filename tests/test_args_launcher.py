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


# The stand-in's modules (``_fake_megatron``). Its functions are compared, signature against
# signature, with the real ones. Up to 0.18, initialize_megatron parses the arguments itself
# and takes the provider, as the stand-in's does; megatron-core 0.19 moved the parsing out: its
# initialize_megatron takes neither and initialize.py no longer imports parse_args, so there
# the parsing functions of the stand-in (_PARSING) are only checked to exist where they still do.
_STAND_IN_MODULES = ("megatron.training.arguments", "megatron.training.initialize",
                     "megatron.training.training", "megatron.training.global_vars")
_PARSING = {("megatron.training.initialize", "initialize_megatron"), ("megatron.training.initialize", "parse_args"),
            ("megatron.training.training", "initialize_megatron")}


def _stand_in_functions(monkeypatch) -> dict:
    """module -> name -> function, as ``_fake_megatron`` builds them (taken back out of
    sys.modules again, so that the real modules can be imported beside them)."""
    with monkeypatch.context() as m:
        _fake_megatron(m, [])
        return {mod: {name: fn for name, fn in vars(sys.modules[mod]).items()
                      if callable(fn) and not name.startswith("_") and not isinstance(fn, type)}
                for mod in _STAND_IN_MODULES}


def _signature_gaps(where: str, stand_in, real) -> list:
    """What makes ``stand_in`` accept a call ``real`` refuses, or refuse one it accepts: a
    parameter the real function lacks (unless it takes ``**kwargs``), a required parameter of
    the real one the stand-in lacks."""
    import inspect

    mine, theirs = inspect.signature(stand_in).parameters, inspect.signature(real).parameters
    var_kw = any(p.kind is p.VAR_KEYWORD for p in theirs.values())
    gaps = [f"{where} has no parameter {n!r}, which the stand-in's has: {list(theirs)}"
            for n, p in mine.items() if n not in theirs and not var_kw and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    gaps += [f"{where} requires {n!r}, which the stand-in's lacks: {list(mine)}"
             for n, p in theirs.items() if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
             and n not in mine]
    return gaps


def test_the_stand_in_has_the_shape_of_the_real_megatron_training(monkeypatch):
    """Each function of the stand-in (its own signature, not a table of it) against the real
    one of the same module. Broken variant (what a stale stand-in looks like): a parameter the
    real function lacks added to the stand-in's parse_args, e.g. ``bogus=None``:
    "megatron.training.arguments.parse_args has no parameter 'bogus', which the stand-in's
    has" (on megatron-core 0.17)."""
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
    stand_in = _stand_in_functions(monkeypatch)
    from megatron.training.initialize import initialize_megatron

    parsing = "extra_args_provider" in inspect.signature(initialize_megatron).parameters  # up to 0.18
    gaps, compared = [], 0
    for module_name, functions in stand_in.items():
        module = importlib.import_module(module_name)
        for name, fn in functions.items():
            real = getattr(module, name, None)
            if (module_name, name) in _PARSING and not parsing:
                # 0.19+: initialize.py no longer imports parse_args; the stand-in's
                # initialize_megatron is the parsing one of <= 0.18
                assert name == "parse_args" or callable(real), f"{module_name} has no {name}()"
                continue
            assert callable(real), f"{module_name} has no {name}(), which the stand-in provides"
            gaps += _signature_gaps(f"{module_name}.{name}", fn, real)
            compared += 1
    assert compared == (5 if parsing else 2), stand_in
    assert not gaps, "\n".join(gaps)
