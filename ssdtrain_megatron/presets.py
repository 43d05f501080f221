"""Finding a preset by name: ``--config llama3-70b`` is ``configs/llama3-70b.yaml``.

Where presets live: ``configs/`` beside the package in a source checkout (and an editable
install), and ``<prefix>/share/ssdtrain-megatron/configs`` in an installed wheel (setup.py's
``data_files``). A value that names an existing file is used as given.
"""

from __future__ import annotations

import os
import sys
from typing import List

SHARE = os.path.join("share", "ssdtrain-megatron", "configs")
"""Where setup.py installs the presets, below ``sys.prefix``."""


class UnknownPreset(ValueError):
    """Neither a file nor a preset name; the message lists the presets."""


def preset_dirs() -> List[str]:
    """Folders searched for ``NAME.yaml``, first match wins: the source checkout's configs/,
    then the installed copy."""
    package = os.path.dirname(os.path.abspath(__file__))
    found = []
    for folder in (os.path.join(os.path.dirname(package), "configs"),
                   os.path.join(sys.prefix, SHARE)):
        if os.path.isdir(folder) and folder not in found:
            found.append(folder)
    return found


def preset_names() -> List[str]:
    """Every preset name found, sorted."""
    names = set()
    for folder in preset_dirs():
        names.update(f[:-len(".yaml")] for f in os.listdir(folder) if f.endswith(".yaml"))
    return sorted(names)


def resolve_preset(value: str, flag: str = "--config") -> str:
    """The file ``value`` names: itself when it exists, else the preset of that name
    (``llama3-70b``, ``llama3-70b.yaml`` or ``configs/llama3-70b.yaml`` from another folder).

    Raises:
        UnknownPreset: one line naming ``flag`` (left out when empty: argparse names it), the
            value and the presets there are.
    """
    if os.path.isfile(value):
        return value
    name = os.path.basename(value)
    name = name[:-len(".yaml")] if name.endswith(".yaml") else name
    if os.path.dirname(value) in ("", "configs"):
        for folder in preset_dirs():
            path = os.path.join(folder, f"{name}.yaml")
            if os.path.isfile(path):
                return path
    head = f"{flag} {value}" if flag else value
    if os.path.isdir(value):
        raise UnknownPreset(f"{head}: is a directory; give a preset name or a YAML file")
    names = preset_names()
    raise UnknownPreset(f"{head}: no such file and no preset of that name; presets: "
                        + (", ".join(names) if names else "none found (searched configs/ beside "
                           f"the package and {os.path.join(sys.prefix, SHARE)})"))
