"""The offloader (and the CLI's file counter) register their exit/signal cleaner under a token
object of their own, not ``id(self)``: an id is an address, handed to another object once this
one is gone, so a cleaner keyed by it could be dropped or replaced by a stranger's."""

from __future__ import annotations

import torch

from ssdtrain_megatron import ActivationOffloader, OffloadConfig
from ssdtrain_megatron.io import cleanup
from tests.drives import mount


def test_each_offloader_registers_its_own_token_and_unregisters_exactly_it(tmp_path, monkeypatch):
    """Broken by registering id(self) again: 'token is an int (an address)'."""
    seen = []
    real = cleanup.register
    monkeypatch.setattr(cleanup, "register", lambda token, *a, **k: (seen.append(token), real(token, *a, **k)))
    before = cleanup.registered()
    offs = [ActivationOffloader(OffloadConfig(dirs=mount(tmp_path / f"r{i}"), job="t"), device=torch.device("cpu"))
            for i in range(2)]
    mine = [t for t in seen if t is not None and any(t is o._cleanup_token for o in offs)]
    assert len(mine) == 2 and mine[0] is not mine[1]
    assert not any(isinstance(t, int) for t in mine), "token is an int (an address)"
    offs[0].close()
    assert cleanup.registered() == before + len(seen) - 1 - 1  # its own cleaner and its engine's
    offs[1].close()
    assert cleanup.registered() == before
