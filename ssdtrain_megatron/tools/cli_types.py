"""What the `ssdtrain` subcommands share: argument types, the errors they report in one line,
checks of the paths users give, progress bars, and deprecated flag spellings.

Nothing here imports torch: every subcommand's parser is built from these, and ``--help`` must
not pay for torch.
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import sys
import warnings
from typing import Any, List, Optional


class CommandError(Exception):
    """A mistake the user can fix, reported as one line on stderr, without a traceback.

    ``exit_code``: 2 for usage (a flag's value), 1 for the environment (the machine refuses)."""

    exit_code = 1


class UsageError(CommandError):
    """A flag's value cannot be used as given; the message names the flag."""

    exit_code = 2


class EnvironmentProblem(CommandError):
    """The machine cannot do what was asked (read-only disk, missing library); the message
    says what to do."""

    exit_code = 1


# -- argument types (argparse names the flag in its one-line error) ---------------------------


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(s|m|h|d)")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    """A duration with its unit (90s, 30m, 12h, 7d), in seconds."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"expected a duration such as 90s, 30m, 12h or 7d, got {text!r}")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def byte_count(text: str) -> int:
    """A size > 0, written as every size flag takes it (:mod:`ssdtrain_megatron.sizes`:
    80GB = 80e9 bytes, 80GiB = 80 * 2^30 bytes, 512MiB, 4096)."""
    from ..sizes import EXPECTED, parse_size

    value = parse_size(text)
    if not value:
        raise argparse.ArgumentTypeError(f"expected {EXPECTED}, above 0; got {text!r}")
    return value


def size_with_unit(text: str) -> int:
    """A size that must carry its unit (80GB, 80GiB, 0B): for flags whose name does not say
    bytes (``--gpu-memory 80`` is refused: "80: give a unit, e.g. 80GB"). Whether 0 makes sense
    is the flag's to say (``--host-memory 0B``: no host tier)."""
    from ..sizes import parse_size_with_unit

    try:
        return parse_size_with_unit(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def size_with_unit_or_fraction(text: str) -> float:
    """A size with its unit (24GiB, 24GB) in bytes, or a fraction of GPU memory in (0, 1]."""
    if re.fullmatch(r"\s*(0*\.\d+|0*1(\.0*)?)\s*", text) and float(text) > 0:
        return float(text)
    size = size_with_unit(text)  # a plain number above 1 is refused here, with its one line
    if not size:
        raise argparse.ArgumentTypeError(f"expected a size above 0 or a fraction in (0, 1]; "
                                         f"got {text!r}")
    return size


def size_with_unit_zero_or_fraction(text: str) -> float:
    """A size with its unit (5GB; 0B: none) in bytes, or a fraction of GPU memory in (0, 1):
    ``ssdtrain plan --memory-reserve``."""
    if re.fullmatch(r"\s*0*\.\d+\s*", text) and float(text) > 0:
        return float(text)
    return size_with_unit(text)  # a plain number is refused here, with its one line


def preset_arg(text: str) -> str:
    """``--config``'s type in every subcommand: a YAML file, or a preset's name (``llama3-70b``
    is configs/llama3-70b.yaml); an unknown one is a usage error (exit 2) that lists the
    presets."""
    from ..presets import UnknownPreset, resolve_preset

    try:
        return resolve_preset(text, flag="")
    except UnknownPreset as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


PRESET_HELP = "a preset name (llama3-70b: configs/llama3-70b.yaml) or a YAML file"


def size_or_fraction(text: str) -> float:
    """A size (24GiB, 24GB) in bytes, or a fraction of GPU memory in (0, 1] (a float)."""
    try:
        value = float(text)
    except ValueError:
        return byte_count(text)
    if 0 < value <= 1:
        return value
    if value > 1 and value.is_integer():
        return int(value)
    raise argparse.ArgumentTypeError(f"expected a size (24GiB, 24GB) or a fraction of "
                                     f"GPU memory in (0, 1], got {text!r}")



def verify_methods(text: str) -> List[str]:
    """``--verify``: one or both of OffloadConfig's verify values, comma-separated
    ('off,crc32c' measures both side by side)."""
    from ..config import VERIFY

    items = [t.strip() for t in text.split(",")]
    if any(t not in VERIFY for t in items) or len(set(items)) != len(items):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected one or both of "
                                         + ", ".join(VERIFY) + ", comma-separated")
    return items

# -- deprecated spellings ---------------------------------------------------------------------


class _Deprecated(argparse.Action):
    """An old spelling of a flag: stores into the new one's ``dest``, warns once on stderr,
    and is hidden from ``--help``."""

    def __init__(self, option_strings, dest, new: str = "", **kwargs) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"{parser.prog}: {option_string} is deprecated, use {self.new}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated_alias(parser: argparse.ArgumentParser, old: str, new: str, dest: str,
                     type: Any = None) -> None:
    """Accept ``old`` as a hidden, deprecated spelling of ``new`` (stored in ``dest``)."""
    parser.add_argument(old, dest=dest, type=type, action=_Deprecated, new=new,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS)


# -- paths the user gives ---------------------------------------------------------------------


def writable_dir(flag: str, path: str, create: bool = True) -> str:
    """Make sure ``path`` (the value of ``flag``) is a directory this process can write into,
    creating it (and its parents) when ``create``; return its absolute path.

    Raises:
        UsageError: the path names a file, or lies under one.
        EnvironmentProblem: the filesystem is read-only, permission is denied, or the disk is
            full; the message names the flag, the path and what to do.
    """
    path = os.path.abspath(os.path.expanduser(path))
    # Walk up to the first part that exists: a file there is a usage mistake, whatever the rest.
    probe = path
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if os.path.lexists(probe) and not os.path.isdir(probe):
        what = "is a file" if probe == path else f"lies under {probe}, which is a file"
        raise UsageError(f"{flag} {path}: {what}, not a directory; give a directory "
                         "(it is created if missing)")
    try:
        if create:
            _make_private_dirs(path)
    except OSError as exc:
        raise EnvironmentProblem(f"{flag} {path}: cannot create it: {_refusal(exc, path)}") from exc
    try:
        fd, name = _probe_file(path)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        # The probe file's random name means nothing to the user: name the directory.
        raise EnvironmentProblem(f"{flag} {path}: cannot write files there: {_refusal(exc, path)}") from exc
    return path


def _make_private_dirs(path: str) -> None:
    """Create ``path`` and its missing parents, each 0700 whatever the umask: under umask 000
    ``os.makedirs`` makes them 0777, and an offload root anyone can write to is refused (another
    user could swap our files there)."""
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)  # the umask can only take bits away
        except FileExistsError:
            pass  # made meanwhile by someone else: checked as any existing directory is


def _refusal(exc: OSError, path: str) -> str:
    """Why creating ``path`` or a file in it failed. ENOENT where the parent exists is a
    filesystem that takes no new entries (/proc, /sys), not a missing folder."""
    if exc.errno == errno.ENOENT and os.path.isdir(os.path.dirname(path) if not os.path.isdir(path) else path):
        return "this filesystem takes no new files (/proc or /sys?); choose a directory on a drive"
    return describe_os_error(exc, path, name=False)


def _probe_file(directory: str):
    import tempfile

    return tempfile.mkstemp(prefix=".ssdtrain-probe-", dir=directory)


def check_engine(flag: str, name: str) -> None:
    """Fail at once, in one line, when IO engine ``name`` cannot run here (before a model is
    built or a baseline measured).

    Raises:
        EnvironmentProblem: what the engine is missing, and where to look.
    """
    from ..io import engine_class

    try:
        ok, why = engine_class(name).is_available()
    except RuntimeError as exc:  # EngineUnavailable: an unknown name
        raise UsageError(f"{flag} {name}: {exc}") from None
    if not ok:
        raise EnvironmentProblem(f"{flag} {name}: cannot run here: {why} "
                                 "(ssdtrain doctor lists what runs here)")


def describe_os_error(exc: OSError, path: str = "", name: bool = True) -> str:
    """What went wrong and what to do, in a few words, for the errors users meet; the file
    the error names comes first unless it is ``path`` (already said) or ``name`` is False."""
    hint = {
        errno.EROFS: "the filesystem is read-only; choose a directory on a writable drive",
        errno.EACCES: "permission denied; choose a directory you can write to",
        errno.EPERM: "operation not permitted; choose a directory you can write to",
        errno.ENOSPC: "no space left on the drive; free some space or choose another drive",
        errno.EDQUOT: "disk quota exceeded; free some space or choose another drive",
        errno.ENOTDIR: "a part of the path is a file, not a directory",
        errno.EEXIST: "a file is in the way where a directory should be",
        errno.ENOENT: "no such file or directory",
    }.get(exc.errno)
    where = f"{exc.filename}: " if exc.filename and name and exc.filename != path else ""
    return where + (hint or (exc.strerror or str(exc)))


def free_space_line(path: str) -> str:
    """'<free> free of <total> on <filesystem type> (<device>)' for the drive holding ``path``."""
    from ..io.where import describe

    return describe(path)


def gib(n: float) -> str:
    """Bytes in binary units (KiB, MiB, GiB, TiB), one decimal."""
    from ..io.where import binary

    return binary(n)


# -- progress ---------------------------------------------------------------------------------


def progress(total: Optional[float] = None, desc: str = "", unit: str = "it",
             enabled: bool = True, **kwargs: Any):
    """A tqdm bar on stderr (rate and time left), silent when stderr is not a terminal or
    ``enabled`` is False. Print other lines with ``bar.write(text)`` so they do not tear it."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True,
                disable=None if enabled else True, leave=True, **kwargs)


def say(bar: Any, text: str) -> None:
    """A line on stderr above the progress bar (plain print when the bar is silent)."""
    if bar is not None and not getattr(bar, "disable", True):
        bar.write(text, file=sys.stderr)
    else:
        print(text, file=sys.stderr, flush=True)


# -- megatron-core's import-time noise --------------------------------------------------------

MEGATRON_NOISE = (r"(Transformer Engine and Apex|Apex) (are|is) not installed",
                  r"full scope is deprecated")
"""megatron-core's warnings on a machine without Transformer Engine and Apex (it then uses its
torch fallbacks, which the demo and the benchmarks are built for) and about a default of its
own config: one header line says it instead."""


def openmp_wait_policy(tool: str) -> str:
    """Set OMP_WAIT_POLICY=PASSIVE for this process unless the environment sets it, while
    torch, whose OpenMP runtime reads it once when it loads, is not yet imported. Returns
    what the run has, for ``tool``'s header (``tool``: "the bench", "the demo").

    Why: on the CPU the model's compute runs on torch's OpenMP team. With the runtime's
    default, a team thread whose peer lost its core to an IO thread busy-waits at the next
    barrier, and the IO threads' CPU shows up a second time as compute, which a GPU's step
    does not have. Set for every strategy a tool compares, it measures offload's own cost."""
    if "OMP_WAIT_POLICY" in os.environ:
        return f"{os.environ['OMP_WAIT_POLICY']} (from the environment)"
    if "torch" in sys.modules:
        return f"the OpenMP runtime's default (torch was loaded before {tool} started)"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return f"PASSIVE (set by {tool}; OMP_WAIT_POLICY=ACTIVE to measure without it)"


def quiet_megatron_warnings() -> None:
    """Silence :data:`MEGATRON_NOISE` for the rest of this command (CLI only: the library
    never touches the warning filters of a training job)."""
    for pattern in MEGATRON_NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)


def plural(n: int, word: str, many: Optional[str] = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"

