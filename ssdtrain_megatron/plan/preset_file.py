"""A preset file read once: its ``offload:``, ``model:``, ``parallel:`` and ``node:`` sections,
for the doors of the one sequence (megatron/follow_node.py, tools/plan/cli.py).

A preset was parsed four to six times at a job's start (the flag's check, the config, the
shape, the node, the fields it sets); the doors now read it here once and take every section
from the one :class:`PresetFile`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple


class PresetPath(str):
    """A preset's path that carries the file as read (:attr:`preset`), so that the flag's check,
    the config and the job's settings read it once."""

    preset: "PresetFile"

from .node import NodeProfile, profile_from_preset
from .shape import ModelShape

SECTIONS = ("model", "parallel", "offload", "node")


@dataclass(frozen=True)
class PresetFile:
    """The sections of one preset file (None where absent)."""

    path: str
    offload: Any
    """The ``offload:`` section (or the whole file without one), as OffloadConfig.from_yaml
    reads it (a mapping, unless the file is wrong)."""
    model: Optional[Dict[str, Any]] = None
    parallel: Optional[Dict[str, Any]] = None
    node: Any = None

    def shape(self) -> Optional[ModelShape]:
        """The preset's model on its layout; None without a ``model:`` section.

        Raises:
            ValueError: the model or parallel section is invalid (one line naming the key).
        """
        if self.model is None:
            return None
        return ModelShape.from_preset(self.model, self.parallel)

    def node_profile(self) -> Optional[NodeProfile]:
        """The preset's ``node:`` section as a profile; None without one."""
        if self.node is None:
            return None
        return profile_from_preset(self.node, source=f"{self.path}: node")

    def fields(self) -> Tuple[str, ...]:
        """The OffloadConfig fields the preset sets."""
        return tuple(str(k) for k in self.offload) if isinstance(self.offload, dict) else ()

    def config(self, source: Optional[str] = None) -> Any:
        """The OffloadConfig of the ``offload:`` section (``source``: how its messages name it;
        default the file).

        Raises:
            ConfigError: an unknown key or invalid value (the message names the file and key).
        """
        from ..config import OffloadConfig

        return OffloadConfig.from_dict(self.offload, source=source or str(self.path))


def read_preset(path: str, strict: bool = False) -> PresetFile:
    """The sections of the preset at ``path`` (a file; names are resolved by presets.py).
    ``strict``: a mapping with a ``model:`` section and no other section is required (what
    ``ssdtrain plan`` plans).

    Raises:
        ValueError: unreadable, not YAML, or (strict) not a preset; one line naming the file.
    """
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            # libyaml's loader where PyYAML has it: the same documents, ten times faster
            data = yaml.load(fh, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) or {}
    except OSError as exc:
        raise ValueError(f"cannot read {path!r}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"{path!r} is not valid YAML: " + " ".join(str(exc).split())) from None
    if strict:
        if not isinstance(data, dict) or "model" not in data:
            raise ValueError(f"{path}: expected a mapping with a model: section")
        unknown = sorted(str(k) for k in data if k not in SECTIONS)
        if unknown:
            raise ValueError(f"{path}: unknown section(s) {', '.join(unknown)}; allowed: "
                             + ", ".join(SECTIONS))
    if not isinstance(data, dict):
        return PresetFile(path, data)  # OffloadConfig.from_dict says what is wrong with it
    if "offload" not in data:  # a file of OffloadConfig fields (OffloadConfig.yaml_section)
        return PresetFile(path, data, data.get("model") if strict else None)
    return PresetFile(path, data["offload"] or {}, data.get("model"), data.get("parallel"),
                      data.get("node"))


def preset_of(path: str) -> PresetFile:
    """The file ``path`` names, read once: the one a :class:`PresetPath` carries, else read."""
    return getattr(path, "preset", None) or read_preset(path)


__all__ = ["PresetFile", "PresetPath", "SECTIONS", "preset_of", "read_preset"]
