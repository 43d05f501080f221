"""Reversible attribute patches: replace, remember, and put back exactly what was there.

A function can be reachable under several names: ``megatron.core.pipeline_parallel`` re-exports
``get_forward_backward_func``, and any module that did ``from ... import forward_step`` holds
its own reference. ``Patcher.replace_function`` therefore swaps every module-level reference
to the original function it finds in ``sys.modules``, and remembers each one, so ``restore()``
undoes all of them. Callers that stored the function somewhere else (an object attribute, a
local variable) before ``install()`` keep the unpatched function; that is documented, not
guessed at.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any, Callable, List

log = logging.getLogger(__name__)

_MISSING = object()


@dataclass
class _Patch:
    owner: Any
    name: str
    original: Any  # what owner.__dict__[name] held, or _MISSING
    replacement: Any


class Installation:
    """One install(): the offloader, the patches, and the hooks' state (``scopes`` with a
    ``recording`` flag, ``pipeline`` with an ``active`` flag)."""

    def __init__(self, offloader, patcher: "Patcher", scopes: Any, pipeline: Any) -> None:
        self.offloader = offloader
        self.patcher = patcher
        self.scopes = scopes
        self.pipeline = pipeline

    def undo(self, close: bool) -> None:
        """Stop the hooks (anything still holding a wrapper runs the original), put every
        patched attribute back, and close the offloader unless ``close`` is False."""
        self.pipeline.active = False
        self.scopes.recording = False
        self.patcher.restore()
        if close:
            self.offloader.close()


class Patcher:
    """Applies attribute patches and restores them in reverse order."""

    def __init__(self) -> None:
        self._patches: List[_Patch] = []

    def __len__(self) -> int:
        return len(self._patches)

    def replace_attribute(self, owner: Any, name: str, replacement: Any) -> None:
        """Set ``owner.name`` (a class or module attribute) to ``replacement``."""
        original = vars(owner).get(name, _MISSING)
        if original is _MISSING and not hasattr(owner, name):
            raise AttributeError(f"{_describe(owner)} has no attribute {name!r} to patch")
        setattr(owner, name, replacement)
        self._patches.append(_Patch(owner, name, original, replacement))

    def replace_function(self, home: Any, name: str, make_replacement: Callable[[Callable], Any]
                         ) -> Callable:
        """Replace the function ``home.name`` everywhere a loaded module refers to it by a
        module-level name. Returns the original function."""
        original = vars(home).get(name, _MISSING)
        if original is _MISSING:
            raise AttributeError(f"{_describe(home)} has no attribute {name!r} to patch")
        replacement = make_replacement(original)
        self.replace_attribute(home, name, replacement)
        for module in list(sys.modules.values()):
            namespace = getattr(module, "__dict__", None)
            if module is home or not isinstance(namespace, dict):
                continue
            for attr, value in list(namespace.items()):
                if value is original:
                    self.replace_attribute(module, attr, replacement)
        return original

    def restore(self) -> None:
        """Put back every patched attribute, newest first. An attribute that someone else has
        changed since we patched it is left as they set it (and logged)."""
        while self._patches:
            p = self._patches.pop()
            current = vars(p.owner).get(p.name, _MISSING)
            if current is not p.replacement:
                log.warning("ssdtrain: %s.%s was changed by someone else after install(); "
                            "leaving their value in place", _describe(p.owner), p.name)
                continue
            if p.original is _MISSING:
                delattr(p.owner, p.name)
            else:
                setattr(p.owner, p.name, p.original)


def _describe(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", repr(owner))
