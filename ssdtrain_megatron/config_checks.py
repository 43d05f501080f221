"""The pieces OffloadConfig is declared with: ``ConfigError``, the per-field checks, and
``knob()``, which puts a field's check, flag and help into the field itself.

Every check is ``check(name, value) -> value``: it returns the value (normalised: a tuple
becomes a list, an int seconds value a float) or raises :class:`ConfigError` naming the field,
the value and what is allowed. ``OffloadConfig.__post_init__`` runs each field's check, then
the few rules that tie two fields together (config.py). ``megatron/args.py`` builds one flag
per field from the same metadata (see :func:`knob`), so a new field gets its flag, help and
validation by being declared. Nothing here probes the machine: capability checks (CUDA,
kvikio, libaio) happen where an engine is built.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import string
from typing import Any, Callable, Optional, Sequence, Tuple

TEMPLATE_KEYS = ("rank", "local_rank", "hostname", "job", "user")

Check = Callable[[str, Any], Any]


class ConfigError(ValueError):
    """An invalid OffloadConfig setting.

    Attributes:
        field: the OffloadConfig field (None for errors about a whole file, e.g. unknown keys).
        value: the offending value (for a list field, the offending item where there is one).
        allowed: what is allowed, in words.
        reason: ``"<value> is invalid: <allowed>"``, the message without the field's name
            (the flags put their own name in front of it).
    """

    def __init__(self, message: str, field: Optional[str] = None, value: Any = None,
                 allowed: Optional[str] = None) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.allowed = allowed

    @classmethod
    def invalid(cls, field: str, value: Any, allowed: str, item: Optional[int] = None) -> "ConfigError":
        """``OffloadConfig.<field>[<item>]=<value> is invalid: <allowed>``."""
        label = field if item is None else f"{field}[{item}]"
        return cls(f"OffloadConfig.{label}={value!r} is invalid: {allowed}", field, value, allowed)

    @property
    def reason(self) -> str:
        if self.field is None:
            return str(self)
        return f"{self.value!r} is invalid: {self.allowed}"


def fail(name: str, value: Any, allowed: str, item: Optional[int] = None) -> None:
    raise ConfigError.invalid(name, value, allowed, item)


def knob(default: Any = dataclasses.MISSING, *, check: Check, help: str,
         default_factory: Any = dataclasses.MISSING, flag: Optional[str] = None,
         metavar: Optional[str] = None, choices: Optional[Sequence[str]] = None,
         unit: Optional[str] = None, deprecated_flags: Sequence[str] = (),
         deprecated_switch: Optional[Tuple[str, Any, Any]] = None) -> Any:
    """A dataclass field of OffloadConfig that carries everything about it.

    Args:
        check: ``check(name, value) -> value``, run by ``__post_init__``.
        help: the flag's help text (one or two sentences; the default is appended).
        flag: the command-line flag, when not ``--ssd-offload-<field-with-dashes>``.
        metavar: the flag's placeholder in --help (default: from the type).
        choices: the allowed strings (shown as the metavar ``{a,b,c}``).
        unit: ``"bytes"``: the flag takes a size (ssdtrain_megatron/sizes.py: 80GB, 80GiB, 4096).
        deprecated_flags: older flag names that still work, hidden from --help.
        deprecated_switch: ``(flag, on, off)``: an older on/off flag (with its ``--no-`` form)
            that still works, hidden from --help, and sets this field to ``on`` or ``off``.
    """
    metadata = {"check": check, "help": help, "flag": flag, "metavar": metavar,
                "choices": tuple(choices) if choices else None, "unit": unit,
                "deprecated_flags": tuple(deprecated_flags), "deprecated_switch": deprecated_switch}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


@functools.lru_cache(maxsize=None)
def warn_deprecated(old: str, new: str) -> None:
    """Log once per process that ``old`` (a flag or a config key) is deprecated for ``new``."""
    logging.getLogger("ssdtrain_megatron.config").warning(
        "ssdtrain: %s is deprecated and will be removed; use %s", old, new)


# -- checks ---------------------------------------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def int_at_least(minimum: int, multiple_of: int = 1, below: Optional[int] = None,
                 optional: bool = False) -> Check:
    """An integer >= ``minimum`` (a multiple of ``multiple_of``, below ``below``); None too
    when ``optional``."""
    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return value
        if not _is_int(value) or value < minimum:
            fail(name, value, f"expected an integer >= {minimum}" + (" or null" if optional else ""))
        if value % multiple_of or (below is not None and value >= below):
            fail(name, value, f"expected a multiple of {multiple_of}"
                 + (f" below {below >> 30} GiB" if below is not None else ""))
        return value
    return check


def number_in(low: float, high: Optional[float] = None, allowed: str = "", optional: bool = False,
              as_float: bool = False) -> Check:
    """A real number > ``low`` (and < ``high``; a float when ``as_float``); None too when
    ``optional``."""
    def check(name: str, value: Any) -> Any:
        if value is None and optional:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > low \
                or (high is not None and not value < high):
            fail(name, value, allowed)
        return float(value) if as_float else value
    return check


def one_of(choices: Sequence[str]) -> Check:
    def check(name: str, value: Any) -> Any:
        if value not in choices:
            fail(name, value, "allowed: " + ", ".join(choices))
        return value
    return check


def activation_budget(name: str, value: Any) -> Any:
    """A byte count >= 1, or a fraction of device memory in (0, 1] (resolved on CUDA), or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
            or (isinstance(value, float) and value > 1 and not value.is_integer()):
        fail(name, value, "expected a byte count >= 1 (e.g. 12GiB), a fraction of device memory "
             "in (0, 1] (CUDA), or null")
    return int(value) if isinstance(value, float) and value > 1 else value


def choice_or_switch(choices: Sequence[str], off: str, on: str) -> Check:
    """One of ``choices``; a boolean too, since YAML reads an unquoted ``off`` / ``on`` as
    false / true: false is ``off``, true is ``on``."""
    pick = one_of(choices)

    def check(name: str, value: Any) -> Any:
        if isinstance(value, bool):
            return on if value else off
        return pick(name, value)
    return check


def boolean(name: str, value: Any) -> Any:
    if not isinstance(value, bool):
        fail(name, value, "expected true or false")
    return value


def path_template(name: str, template: Any, item: Optional[int] = None) -> Any:
    """A non-empty path that may use {rank}, {local_rank}, {hostname}, {job}, {user}, without '..'."""
    if not isinstance(template, str) or not template.strip():
        fail(name, template, "expected a non-empty path string", item)
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        fail(name, template, f"not a valid path template ({exc})", item)
    for f in fields:
        if f not in TEMPLATE_KEYS:
            fail(name, template, f"unknown placeholder {{{f}}}; allowed: "
                 + ", ".join("{%s}" % k for k in TEMPLATE_KEYS), item)
    if ".." in template.replace("\\", "/").split("/"):
        fail(name, template, "'..' is not allowed in the path", item)
    if "\x00" in template:
        fail(name, template, "NUL byte in path", item)
    return template


def optional_path_template(allowed: str) -> Check:
    def check(name: str, value: Any) -> Any:
        if value is None:
            return value
        if not isinstance(value, str) or not value:
            fail(name, value, allowed)
        return path_template(name, value)
    return check


def path_templates(name: str, value: Any) -> Any:
    """A non-empty list of path templates (a tuple is accepted and becomes a list)."""
    if isinstance(value, str):
        fail(name, value, "expected a list of path templates, e.g. ['/mnt/nvme0/ssdtrain']")
    if not isinstance(value, (list, tuple)) or not value:
        fail(name, value, "expected a non-empty list of path templates")
    for i, template in enumerate(value):
        path_template(name, template, item=i)
    return list(value)


def layer_numbers(name: str, value: Any) -> Any:
    """A list of 1-based layer numbers (a tuple is accepted and becomes a list)."""
    if not isinstance(value, (list, tuple)) or not all(_is_int(n) and n >= 1 for n in value):
        fail(name, value, "expected a list of layer numbers >= 1")
    return list(value)


def cpu_numbers(name: str, value: Any) -> Any:
    """A list of CPU numbers (>= 0; a tuple is accepted and becomes a list)."""
    if not isinstance(value, (list, tuple)) or not all(_is_int(n) and n >= 0 for n in value):
        fail(name, value, "expected a list of CPU numbers >= 0")
    return list(value)


def job_name(name: str, value: Any) -> Any:
    if value is not None and (not isinstance(value, str) or not value or "/" in value
                              or value in (".", "..")):
        fail(name, value, "expected a non-empty name without '/'")
    return value


def field_checks(cls: type) -> Tuple[Tuple[str, Check], ...]:
    """(name, check) of every field of dataclass ``cls``, in declaration order."""
    return tuple((f.name, f.metadata["check"]) for f in dataclasses.fields(cls))
