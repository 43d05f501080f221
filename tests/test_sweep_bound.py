"""The start-up sweep (io/clean.py ``bounded_template_roots``) stays cheap on a big shared
filesystem: literal components are looked up, not listed; a placeholder component lists at most
MAX_SWEEP_ENTRIES entries; it never descends into another user's directories. Real directories."""

from __future__ import annotations

import logging
import os

from ssdtrain_megatron.io import clean
from ssdtrain_megatron.io.clean import bounded_template_roots, template_roots


def _tree(tmp_path, jobs=5):
    shared = tmp_path / "scratch"
    for j in range(jobs):
        (shared / f"job{j}" / "ssd").mkdir(parents=True)
    (shared / "job0-no-ssd").mkdir()
    for name in ("big1", "big2"):  # siblings of the template's path: never listed
        (tmp_path / name).mkdir()
        for i in range(20):
            (tmp_path / name / f"d{i}").mkdir()
    return str(shared / "{job}" / "ssd")


def test_same_roots_as_the_full_lookup_and_only_the_placeholders_parent_is_listed(tmp_path, monkeypatch):
    """Broken by listing every component (glob): 'listed ['/', ...]'."""
    template = _tree(tmp_path)
    full = template_roots(template)
    listed = []
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p=".": (listed.append(str(p)), real(p))[1])
    got = bounded_template_roots(template)
    assert got == full and len(got) == 5
    assert listed == [str(tmp_path / "scratch")], f"listed {listed}"


def test_at_most_max_entries_are_listed_and_the_log_says_so(tmp_path, monkeypatch, caplog):
    """Broken by dropping the bound in _matching_dirs: 'found 5 of 5 roots'."""
    template = _tree(tmp_path)
    with caplog.at_level(logging.WARNING, logger="ssdtrain_megatron"):
        got = bounded_template_roots(template, max_entries=3)
    assert len(got) <= 3, f"found {len(got)} of 5 roots"
    assert "stopped after 3 entries" in caplog.text and "ssdtrain clean" in caplog.text


def test_other_users_directories_are_not_entered(tmp_path, monkeypatch):
    """As a user other than the directories' owner, nothing under them is followed (root, the
    owner here, may sweep anyone's). Broken by dropping the owner check: '5 foreign roots'."""
    template = _tree(tmp_path)
    owner = os.stat(tmp_path / "scratch").st_uid
    monkeypatch.setattr(clean.os, "getuid", lambda: owner + 4242)
    got = bounded_template_roots(template)
    assert got == [], f"{len(got)} foreign roots"
    monkeypatch.setattr(clean.os, "getuid", lambda: owner)
    assert len(bounded_template_roots(template)) == 5


def test_the_start_up_sweep_takes_the_bounded_lookup(tmp_path, monkeypatch):
    """Broken by sweeping with template_roots (unbounded): 'start-up sweep looked up []'."""
    template = _tree(tmp_path)
    seen = []
    real = clean.bounded_template_roots
    monkeypatch.setattr(clean, "bounded_template_roots", lambda t, *a, **k: (seen.append(t), real(t, *a, **k))[1])
    clean.sweep_before_start([], [template])
    assert seen == [template], f"start-up sweep looked up {seen}"
