"""Every class owns the state it uses: read from the source (AST), nothing imported.

A class may read ``self._x`` only when it, or one of its base classes in the package, defines
``_x`` (a method, a class attribute, a slot, or an assignment ``self._x = ...``). A mixin that
uses what its subclass sets (``self._engine`` read in one file, set in another) fails here:
the parts of the offloader (cache/) and of the engines (io/) receive their collaborators at
construction instead. And no class reaches through a collaborator into its private state
(``self._table._records``): it calls the collaborator's methods.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set, Tuple

PKG = pathlib.Path(__file__).resolve().parent.parent / "ssdtrain_megatron"


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


class _Class:
    def __init__(self, module: str, node: ast.ClassDef) -> None:
        self.module = module
        self.name = node.name
        self.bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "") for b in node.bases]
        self.defined: Set[str] = set()
        self.used: Dict[str, int] = {}  # private name -> first line that reads it
        self.reached: List[Tuple[str, int]] = []  # self.<a>.<_private> reads: (text, line)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(item.name)
            targets = item.targets if isinstance(item, ast.Assign) else \
                [item.target] if isinstance(item, ast.AnnAssign) else []
            for t in targets:
                if isinstance(t, ast.Name):
                    self.defined.add(t.id)
                    if t.id == "__slots__" and isinstance(item, ast.Assign):
                        try:
                            self.defined.update(ast.literal_eval(item.value))
                        except ValueError:
                            pass
        for sub in ast.walk(node):
            if not isinstance(sub, ast.Attribute):
                continue
            if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                if isinstance(sub.ctx, (ast.Store, ast.Del)):
                    self.defined.add(sub.attr)
                elif _private(sub.attr):
                    self.used.setdefault(sub.attr, sub.lineno)
            elif _private(sub.attr) and isinstance(sub.value, ast.Attribute) \
                    and isinstance(sub.value.value, ast.Name) and sub.value.value.id == "self" \
                    and isinstance(sub.ctx, ast.Load):
                self.reached.append((f"self.{sub.value.attr}.{sub.attr}", sub.lineno))


def _classes(root: pathlib.Path) -> List[_Class]:
    out = []
    for path in sorted(root.rglob("*.py")):
        module = str(path.relative_to(root.parent))
        for node in ast.walk(ast.parse(path.read_text(), module)):
            if isinstance(node, ast.ClassDef):
                out.append(_Class(module, node))
    return out


def _inherited(cls: _Class, by_name: Dict[str, List[_Class]], seen: frozenset = frozenset()) -> Set[str]:
    """What the class's bases in the package define (by name: a base outside the package,
    torch's or the standard library's, defines nothing private for us)."""
    out: Set[str] = set()
    for base in cls.bases:
        if base in seen:
            continue
        for b in by_name.get(base, []):
            out |= b.defined | _inherited(b, by_name, seen | {base})
    return out


def ownership_problems(root: pathlib.Path) -> List[str]:
    classes = _classes(root)
    by_name: Dict[str, List[_Class]] = {}
    for c in classes:
        by_name.setdefault(c.name, []).append(c)
    problems = []
    for c in classes:
        own = c.defined | _inherited(c, by_name)
        for name, line in sorted(c.used.items(), key=lambda kv: kv[1]):
            if name not in own:
                problems.append(f"{c.module}:{line}: {c.name} reads self.{name}, which neither it nor "
                                f"its bases define: receive it at construction")
        for text, line in c.reached:
            problems.append(f"{c.module}:{line}: {c.name} reads {text}, a collaborator's private state: "
                            f"call a method of it")
    return problems


def test_every_class_in_the_package_uses_only_state_it_or_its_bases_define():
    assert ownership_problems(PKG) == []


def test_the_ownership_check_finds_a_mixin_and_a_reach_into_a_collaborator(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "part.py").write_text(
        "class Mixin:\n"
        "    def hook(self):\n"
        "        return self._engine.write()\n"
        "class Base:\n"
        "    _limit = 1\n"
        "    def __init__(self):\n"
        "        self._table = None\n")
    (pkg / "face.py").write_text(
        "from .part import Base, Mixin\n"
        "class Face(Mixin, Base):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self._engine = object()\n"
        "    def uses(self):\n"
        "        return self._table, self._limit, self._engine, self._table._records\n")
    assert ownership_problems(pkg) == [
        "pkg/face.py:7: Face reads self._table._records, a collaborator's private state: call a method of it",
        "pkg/part.py:3: Mixin reads self._engine, which neither it nor its bases define: receive it at construction",
    ]
