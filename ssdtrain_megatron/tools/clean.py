"""``ssdtrain clean``: remove the offload files of jobs whose process is gone.

The command only chooses where to look and prints what it found; what counts as ours, and
dead, and how it is removed, is the library's (``io/clean.py``), which every disk engine also
runs at start-up.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Optional, Sequence, Tuple

from ..io.clean import LIVE, STALE, Leftover, human_bytes, clean_templates, clean_tree, held_by, template_roots
from ..io.owner import OpenFiles
from ..io.sweepfd import Skips
from .cli_types import PRESET_HELP, duration, preset_arg


def add_clean_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``ssdtrain clean [--dry-run] [--older-than DURATION] [--config PRESET]
    [--dirs TEMPLATES] [ROOT...]``."""
    p = subparsers.add_parser(
        "clean", help="remove offload files left by jobs whose process is gone",
        description="Remove the rank directories (ssdtrain.<job>.<host>.rank<r>.pid<pid>) that dead "
                    "processes left: below each ROOT at any depth (e.g. the drive or the folder "
                    "above the job ids), or in every directory the offload path templates of a "
                    "preset (--config) or of --dirs name on this host, for any job id and rank. "
                    "The folders a removal leaves empty are removed too when the dead job made "
                    "them: below a ROOT, those up to the folder named after its job id and owned "
                    "by its user (never ROOT or above); with templates, those from the first {job} "
                    "component on. A directory goes only when no "
                    "process holds the lock on its owner.json and every holder would share this "
                    "kernel's locks (written on this boot of this node, in any container, or "
                    "before this node booted on a local filesystem). Directories of running "
                    "processes, of other machines or boots on a shared filesystem, and anything "
                    "we did not create are left alone (--older-than for the former). Symlinks "
                    "below ROOT are not followed; only folders of the user it removes for (run as "
                    "root: each folder's owner) are walked, at most 64 levels deep; one line says "
                    "what was skipped. A live directory whose job is gone names the process that "
                    "holds its lock (a child forked from C). The exit "
                    "code is 1 when a root could not be read or a stale directory could not be "
                    "removed.")
    p.add_argument("--dry-run", action="store_true", help="only report what would be removed")
    p.add_argument("--older-than", metavar="DURATION", type=duration,
                   help="also remove the directories whose owner's life cannot be told (written by "
                        "another machine or an earlier boot on a shared filesystem, or in another "
                        "container by a version that took no lock) when nothing in them changed "
                        "for DURATION (90s, 30m, 12h, 7d): what a dead container or node left. A "
                        "job idle that long there loses its files; a locked directory is never "
                        "removed")
    p.add_argument("--config", metavar="PRESET", type=preset_arg,
                   help=f"{PRESET_HELP}: clean where its offload dirs templates point on this "
                        "host")
    p.add_argument("--dirs", metavar="TEMPLATES",
                   help="offload path templates, comma-separated as for --ssd-offload-dir "
                        "(e.g. '/mnt/nvme{local_rank}/ssdtrain/{job}'): clean where they point "
                        "on this host")
    p.add_argument("roots", nargs="*", metavar="ROOT",
                   help="a folder holding offload directories at any depth (a drive, an offload "
                        "root, the folder above the job ids), or a template from OffloadConfig.dirs "
                        "({job}, {rank}, ... match any directory there)")
    p.set_defaults(func=run_clean)
    return p


def _templates(args: argparse.Namespace) -> Optional[List[str]]:
    """The templates of --config and --dirs; None (after a line on stderr) when the preset
    cannot be read."""
    templates: List[str] = []
    if getattr(args, "config", None):
        from ..config import ConfigError, OffloadConfig

        try:
            templates += OffloadConfig.from_yaml(args.config).dirs
        except (OSError, ConfigError) as exc:
            print(f"ssdtrain clean: --config {args.config}: {getattr(exc, 'strerror', None) or exc}",
                  file=sys.stderr)
            return None
    if getattr(args, "dirs", None):
        templates += [t for t in args.dirs.split(",") if t]
    return templates


def _batches(roots: Sequence[str], templates: List[str]) -> List[Tuple[str, Optional[List[str]]]]:
    """What to clean: each plain ROOT as a tree, and the templates (with every ROOT written as
    a template, /mnt/nvme0/ssdtrain/{job} as in the config) together."""
    batches: List[Tuple[str, Optional[List[str]]]] = []
    for root in roots:
        if "{" not in root:
            batches.append((root, None))
        elif template_roots(root):
            templates.append(root)
        else:
            print(f"ssdtrain clean: {root}: no directory matches", file=sys.stderr)
    if templates:
        batches.append((", ".join(templates), templates))
    return batches


def _report(found: List[Leftover], dry_run: bool, totals: Dict[str, int], open_files: OpenFiles) -> int:
    """One line per rank directory found (added to ``totals``); 1 if a removal failed."""
    status = 0
    for item in found:
        if item.verdict == STALE:
            if item.error:
                print(f"failed   {item.describe()}: {item.error}")
                status = 1
                continue
            print(f"{'would remove' if dry_run else 'removed':<8} {item.describe()}")
            totals["dirs"] += 1
            totals["bytes"] += item.nbytes
            for folder in item.pruned:
                print(f"removed  {folder} (empty job folder)")
                totals["folders"] += 1
        elif item.verdict == LIVE:
            held = held_by(item, open_files)
            print(f"live     {item.describe()}" + (f": {held}" if held else ""))
        else:
            print(f"skipped  {item.describe()}")
    return status


def run_clean(args: argparse.Namespace) -> int:
    """Print one line per rank directory found; returns the exit code."""
    templates = _templates(args)
    if templates is None:
        return 2
    if not args.roots and not templates:
        print("ssdtrain clean: name at least one ROOT, or --config PRESET, or --dirs TEMPLATES",
              file=sys.stderr)
        return 2
    status = 0
    totals: Dict[str, int] = {"dirs": 0, "bytes": 0, "folders": 0}
    skips = Skips()
    open_files = OpenFiles()
    for name, batch_templates in _batches(args.roots, templates):
        try:
            if batch_templates is None:
                found = clean_tree(name, dry_run=args.dry_run, older_than=args.older_than, skips=skips)
            else:
                found = clean_templates(batch_templates, dry_run=args.dry_run, older_than=args.older_than,
                                        skips=skips)
        except OSError as exc:
            print(f"ssdtrain clean: {name}: {exc.strerror or exc}", file=sys.stderr)
            status = 1
            continue
        status = max(status, _report(found, args.dry_run, totals, open_files))
    if skips.line():
        print(skips.line())
    verb = "would free" if args.dry_run else "freed"
    folders = f", {totals['folders']} empty folder{'' if totals['folders'] == 1 else 's'} removed" \
        if totals["folders"] else ""
    print(f"{totals['dirs']} stale director{'y' if totals['dirs'] == 1 else 'ies'}, {verb} "
          f"{human_bytes(totals['bytes'])}{folders}")
    return status
