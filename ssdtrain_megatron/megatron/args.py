"""The ``--ssd-offload`` flags: one argument group in Megatron's style, and the OffloadConfig
they describe.

``add_ssd_offload_args(parser)`` adds the group "ssd offload" to any argparse parser (it is a
Megatron ``extra_args_provider``: it returns the parser). Besides the named flags
(``--ssd-offload``, ``--ssd-offload-dir``, ``--ssd-offload-engine``, ``--ssd-offload-config``,
``--ssd-offload-policy``, ``--ssd-offload-recompute-fallback``) there is one flag per remaining
OffloadConfig field, built from the field itself (its ``knob()`` metadata in config.py: help,
flag name when not the default, metavar, unit, deprecated names; its annotation for the value
parser, flag_values.py), so the flags cannot fall out of step with it and a new field gets its
flag by being declared: ``keep_last_layers`` becomes ``--ssd-offload-keep-last-layers``, a
boolean field gets a ``--no-`` form as well.

Every knob defaults to None, meaning "not given": ``config_from_args`` starts from the
OffloadConfig defaults, applies the preset named by ``--ssd-offload-config`` (its ``offload:``
section), then the flags given explicitly. Each value is checked by OffloadConfig's own
validation as it is parsed, and the combination right after parsing, so a bad value stops the
program before Megatron starts, in one line that names the flag.

Nothing here imports megatron.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..config import ConfigError, OffloadConfig
from .flag_values import field_type

GROUP_TITLE = "ssd offload"
FLAG_PREFIX = "--ssd-offload"

# -- the flag of each field ----------------------------------------------------------------


def _fields() -> Dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(OffloadConfig)}


def flag_for(field_name: str) -> str:
    """The command-line flag that sets OffloadConfig field ``field_name``: the field's own
    ``flag`` (see config_checks.knob), else ``--ssd-offload-<field-with-dashes>``."""
    flag = _fields()[field_name].metadata.get("flag")
    return flag or f"{FLAG_PREFIX}-{field_name.replace('_', '-')}"


def dest_for(field_name: str) -> str:
    """The attribute of the parsed namespace that holds ``field_name``'s flag."""
    return flag_for(field_name)[2:].replace("-", "_")


def field_flags() -> Dict[str, str]:
    """{OffloadConfig field: flag}, in the dataclass's field order."""
    return {name: flag_for(name) for name in _fields()}


# -- parsing one value ----------------------------------------------------------------------


def _check_field(name: str, value: Any) -> Any:
    """``value`` if OffloadConfig accepts it for ``name`` (with the other fields at their
    defaults), else ArgumentTypeError with OffloadConfig's reason."""
    try:
        OffloadConfig(**{name: value})
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.reason) from None
    return value


def _validated(name: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_and_check(text: str) -> Any:
        return _check_field(name, parse(text))

    parse_and_check.__name__ = flag_for(name)  # argparse names the type in some messages
    return parse_and_check


def _preset(path: str) -> str:
    """``--ssd-offload-config``: the file (a preset's name, ``llama3-70b``, finds
    configs/llama3-70b.yaml), once its offload section has loaded and validated; the path
    carries the file as read (plan/preset_file.PresetPath), so nothing reads it again."""
    from ..plan.preset_file import PresetPath, read_preset
    from ..presets import UnknownPreset, resolve_preset

    try:
        path = resolve_preset(path, flag="")
    except UnknownPreset as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        preset = read_preset(path)
    except ValueError as exc:  # unreadable, or not YAML: one line
        raise argparse.ArgumentTypeError(str(exc)) from None
    try:
        preset.config()
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    carried = PresetPath(path)
    carried.preset = preset
    return carried


def _node(value: str) -> str:
    """``--ssd-offload-node``: a built-in node profile's name or a profile file, once it loads."""
    from ..plan.node import load_profile

    try:
        load_profile(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


# -- the group ------------------------------------------------------------------------------


def add_ssd_offload_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the "ssd offload" argument group to ``parser`` and return the parser.

    Usable as Megatron's ``extra_args_provider``. After ``parser.parse_args()`` the namespace
    has ``ssd_offload`` (bool) and one attribute per flag (None when not given); pass it to
    :func:`config_from_args`. Parsing also checks that the preset and the flags together make
    a valid OffloadConfig when ``--ssd-offload`` is given, and stops with ``parser.error``
    naming the flag otherwise.

    Example:
        >>> parser = add_ssd_offload_args(argparse.ArgumentParser())
        >>> args = parser.parse_args(["--ssd-offload", "--ssd-offload-dir", "/mnt/nvme0/x"])
        >>> config_from_args(args).dirs
        ['/mnt/nvme0/x']
    """
    if "--ssd-offload" in parser._option_string_actions:
        return parser  # already added (a patched script run by the launcher)
    defaults = OffloadConfig()
    group = parser.add_argument_group(title=GROUP_TITLE)
    group.add_argument("--ssd-offload", action="store_true",
                       help="Offload activations to local SSDs during training "
                            "(ssdtrain-megatron). Without it the other --ssd-offload-* flags "
                            "have no effect.")
    group.add_argument("--ssd-offload-config", type=_preset, default=None, metavar="PRESET",
                       help="a preset name (llama3-70b: configs/llama3-70b.yaml) or a YAML "
                            "file; its offload: section sets the defaults that the other "
                            "--ssd-offload-* flags override.")
    group.add_argument("--ssd-offload-node", type=_node, default=None, metavar="NAME|PATH",
                       help="the node the job's settings are planned for (engine, policy, host "
                            "pool, places per layer): a built-in profile (dgx-h100, gh200, ...) "
                            "or a file `ssdtrain doctor --node-profile` wrote; default: the "
                            "preset's node: section, else dgx-h100. Its host memory is what is "
                            "free on the node at the start.")
    hints = typing.get_type_hints(OffloadConfig)  # once: resolving them is most of the build
    for field in dataclasses.fields(OffloadConfig):
        kwargs = _argument(field, getattr(defaults, field.name), hints)
        group.add_argument(flag_for(field.name), **kwargs)
        for old in field.metadata.get("deprecated_flags", ()):
            group.add_argument(old, **dict(kwargs, help=argparse.SUPPRESS,
                                           action=_deprecated(kwargs.get("action"), flag_for(field.name))))
        switch = field.metadata.get("deprecated_switch")
        if switch:
            group.add_argument(switch[0], dest=dest_for(field.name), default=None, help=argparse.SUPPRESS,
                               action=_deprecated_switch(flag_for(field.name), switch[1], switch[2]))
    _check_after_parsing(parser)
    return parser


def _argument(field: dataclasses.Field, default: Any, hints: Dict[str, Any]) -> Dict[str, Any]:
    """The ``add_argument`` keywords of OffloadConfig field ``field``'s flag, from the field
    (``hints``: OffloadConfig's resolved annotations)."""
    parse, is_bool = field_type(field.name, hints)
    kwargs: Dict[str, Any] = {"dest": dest_for(field.name), "default": None,
                              "help": _help(field.metadata.get("help") or f"OffloadConfig.{field.name}",
                                            default)}
    if is_bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = _validated(field.name, parse)
        kwargs["metavar"] = _metavar(field, hints)
    return kwargs


def _deprecated(action: Optional[type], new_flag: str) -> type:
    """An argparse action for an old flag name: warns once that ``new_flag`` replaces it, then
    does what ``action`` (default: store) does."""
    base = action or argparse._StoreAction

    class Deprecated(base):  # type: ignore[misc, valid-type]
        def __call__(self, parser, namespace, values, option_string=None):
            import warnings

            warnings.warn(f"{option_string} is deprecated; use {new_flag}", FutureWarning, stacklevel=2)
            super().__call__(parser, namespace, values, option_string)

    return Deprecated


def _deprecated_switch(new_flag: str, on: Any, off: Any) -> type:
    """An argparse action for an old on/off flag (``--x`` / ``--no-x``) that a choice flag
    replaced: stores ``on`` or ``off`` in the new flag's dest, and logs once that ``new_flag``
    replaces it."""
    from ..config_checks import warn_deprecated

    class DeprecatedSwitch(argparse.BooleanOptionalAction):
        def __call__(self, parser, namespace, values, option_string=None):
            value = off if option_string.startswith("--no-") else on
            warn_deprecated(option_string, f"{new_flag} {value}")
            setattr(namespace, self.dest, value)

    return DeprecatedSwitch


def _help(text: str, default: Any) -> str:
    if "default" in text.lower():
        return text
    if isinstance(default, bool):
        shown = str(default).lower()
    elif isinstance(default, list):
        shown = ",".join(map(str, default)) or "none"
    else:
        shown = "unset" if default is None else str(default)
    return f"{text} (default: {shown})".replace("%", "%%")


def _metavar(field: dataclasses.Field, hints: Dict[str, Any]) -> str:
    """The field's own ``metavar``, else one from its choices, unit or type."""
    meta = field.metadata
    if meta.get("metavar"):
        return meta["metavar"]
    if meta.get("choices"):
        return "{" + ",".join(meta["choices"]) + "}"
    if meta.get("unit") == "bytes":
        return "BYTES"
    hint = hints[field.name]
    if typing.get_origin(hint) is typing.Union:
        hint = next(a for a in typing.get_args(hint) if a is not type(None))
    if typing.get_origin(hint) is list:
        return "N[,N...]" if typing.get_args(hint) == (int,) else "ITEM[,ITEM...]"
    return "N" if hint is int else "VALUE"


def _check_after_parsing(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` validate the combined OffloadConfig right after it parses.

    Wraps this one parser object's ``parse_known_args`` (``parse_args`` goes through it);
    nothing else is touched. Cross-field errors (e.g. engine 'memory' with
    ``host_memory_bytes`` 0, from the preset and a flag together) then stop the program at
    parse time, like a bad single value."""
    if getattr(parser, "_ssd_offload_checked", False):
        return
    original = parser.parse_known_args

    def parse_known_args(args: Optional[Sequence[str]] = None, namespace: Any = None):
        namespace, extras = original(args, namespace)
        if getattr(namespace, "ssd_offload", False):
            try:
                config_from_args(namespace)
            except ConfigError as exc:
                parser.error(_flag_message(namespace, exc))
        return namespace, extras

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]
    parser._ssd_offload_checked = True  # type: ignore[attr-defined]


def _flag_message(args: argparse.Namespace, exc: ConfigError) -> str:
    """Name the flag (or the preset) a combined-config error comes from: the flag of
    ``exc.field`` when that flag was given, else the preset."""
    if exc.field is not None and getattr(args, dest_for(exc.field), None) is not None:
        return f"argument {flag_for(exc.field)}: {exc.reason}"
    preset = getattr(args, "ssd_offload_config", None)
    if preset:
        return f"argument --ssd-offload-config: {preset}: {exc}"
    return str(exc)


# -- from parsed flags to OffloadConfig -----------------------------------------------------


def explicit_fields(args: argparse.Namespace) -> Dict[str, Any]:
    """{OffloadConfig field: value} for every field flag given on the command line."""
    given = {}
    for name in field_flags():
        value = getattr(args, dest_for(name), None)
        if value is not None:
            given[name] = value
    return given


def given_flags(args: argparse.Namespace) -> List[str]:
    """Every --ssd-offload-* knob given on the command line (not --ssd-offload itself)."""
    flags = [flag_for(name) for name in explicit_fields(args)]
    if getattr(args, "ssd_offload_node", None) is not None:
        flags.insert(0, "--ssd-offload-node")
    if getattr(args, "ssd_offload_config", None) is not None:
        flags.insert(0, "--ssd-offload-config")
    return flags


def given_fields(args: argparse.Namespace) -> Dict[str, str]:
    """{OffloadConfig field: who set it} for every field a flag or the preset sets: the flag
    (``--ssd-offload-engine``) wins over ``the preset``. The fields missing here keep their
    defaults, and those of plan/engine_choice.FOLLOWS_THE_NODE follow the node."""
    from ..plan.preset_file import preset_of

    preset = getattr(args, "ssd_offload_config", None)
    given = {name: "the preset" for name in (preset_of(preset).fields() if preset else ())}
    given.update({name: flag_for(name) for name in explicit_fields(args)})
    return given


def config_from_args(args: argparse.Namespace) -> OffloadConfig:
    """The OffloadConfig the parsed flags describe: defaults < preset < explicit flags.

    Raises:
        ConfigError: the preset or the combination is invalid (the message names the field).
        OSError: the preset cannot be read.
    """
    from ..plan.preset_file import preset_of

    preset = getattr(args, "ssd_offload_config", None)
    base = preset_of(preset).config() if preset else OffloadConfig()
    changes = explicit_fields(args)
    # dataclasses.replace runs __post_init__ again: the combination is validated as a whole.
    return base.replace(**changes) if changes else base


def with_ssd_offload_args(extra_args_provider: Optional[Callable] = None) -> Callable:
    """An ``extra_args_provider`` that runs ``extra_args_provider`` (if any), then adds the
    ssd offload group. For scripts that already pass their own provider to ``pretrain()``."""
    if extra_args_provider is None:
        return add_ssd_offload_args

    def provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        result = extra_args_provider(parser)
        return add_ssd_offload_args(result if result is not None else parser)

    return provider


# A preset's model and layout as Megatron flags (preset_flags.py), here too: users look for
# every flag in this module, and `python -m ssdtrain_megatron.megatron.args PRESET` prints them.
from . import preset_flags  # noqa: E402 (after the flags it does not need)

megatron_args_from_preset = preset_flags.megatron_args_from_preset

if __name__ == "__main__":
    raise SystemExit(preset_flags.main())
