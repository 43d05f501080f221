"""A preset file read once: its ``offload:``, ``model:``, ``parallel:`` and ``node:`` sections,
for the doors of the one sequence (megatron/follow_node.py, tools/plan/cli.py).

A preset was parsed four to six times at a job's start (the flag's check, the config, the
shape, the node, the fields it sets); the doors now read it here once and take every section
from the one :class:`PresetFile`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .node import NodeProfile, profile_from_preset
from .shape import ModelShape

SECTIONS = ("model", "parallel", "offload", "node")


@dataclass(frozen=True)
class PresetFile:
    """The sections of one preset file (None where absent)."""

    path: str
    offload: Dict[str, Any]
    """The ``offload:`` section (or the whole file where it has no sections), as OffloadConfig
    reads it."""
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
        return tuple(str(k) for k in self.offload)

    def config(self) -> Any:
        """The OffloadConfig of the ``offload:`` section.

        Raises:
            ConfigError: an unknown key or invalid value (the message names the file and key).
        """
        from ..config import OffloadConfig

        return OffloadConfig.from_dict(self.offload, source=str(self.path))


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
            data = yaml.safe_load(fh) or {}
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
        return PresetFile(path, {})
    if "offload" not in data and "model" not in data:  # a file of OffloadConfig fields
        return PresetFile(path, data)
    return PresetFile(path, data.get("offload") or {}, data.get("model"), data.get("parallel"),
                      data.get("node"))


__all__ = ["PresetFile", "SECTIONS", "read_preset"]
