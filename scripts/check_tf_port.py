"""Check that every test method of the pinned TensorFlow files is ported or listed as not ported.

The TF test sources are not part of this repository (they are TensorFlow's code).
What is committed is, per TF file, the list of its test methods
(``tests/tf_port/manifest/<file>.txt``, first line: where it came from). This
script checks three sources against each other:

- the manifests (every ``Class::method`` a pinned TF file defines),
- the ``@tf_source("file.py::Class::method", ...)`` marks in ``tests/tf_port/test_*.py``,
- the backticked ``Class::method`` entries under each ``## file.py`` heading of
  ``tests/tf_port/NOT_PORTED.md``.

Every manifest method must be in exactly one of the last two; every mark and
entry must name a manifest method. With ``--tf-src DIR`` (a TensorFlow checkout
or source tree) it first checks the manifests against the sources themselves:
every method whose name starts with ``test`` in a class of the file.
Usage: python scripts/check_tf_port.py [--tf-src DIR] [--write]
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path
from typing import Dict, List, Set

ROOT = Path(__file__).resolve().parent.parent
PORT = ROOT / "tests" / "tf_port"
MANIFESTS = PORT / "manifest"
NOT_PORTED = PORT / "NOT_PORTED.md"
TF_DIR = "tensorflow/python/distribute"
# The TF 2.21 files the issue names (tf.distribute's unit tests a port must cover).
FILES = (
    "values_test.py",
    "distributed_variable_test.py",
    "mirrored_variable_test.py",
    "input_lib_test.py",
    "strategy_common_test.py",
    "distribute_lib_test.py",
    "one_device_strategy_test.py",
    "mirrored_strategy_test.py",
    "collective_all_reduce_strategy_test.py",
    "cross_device_ops_test.py",
    "custom_training_loop_input_test.py",
)
ENTRY = re.compile(r"`([A-Za-z_][\w]*::[A-Za-z_]\w*)`")


def source_methods(path: Path) -> List[str]:
    """``Class::method`` for every ``test*`` method defined in a class of a TF test file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name.startswith("test"):
                    out.append(f"{node.name}::{item.name}")
    return out


def read_manifest(name: str) -> List[str]:
    path = MANIFESTS / (name[:-3] + ".txt")
    if not path.exists():
        return []
    lines = [ln.strip() for ln in path.read_text().splitlines()]
    return [ln for ln in lines if ln and not ln.startswith("#")]


def ported_marks() -> Dict[str, List[str]]:
    """Every id in a ``tf_source(...)`` call of tests/tf_port/test_*.py, with where it is."""
    found: Dict[str, List[str]] = {}
    for path in sorted(PORT.glob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "tf_source":
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        found.setdefault(arg.value, []).append(f"{path.name}:{node.lineno}")
    return found


def not_ported_entries() -> Dict[str, int]:
    """``file.py::Class::method`` -> line number, for each entry of NOT_PORTED.md."""
    entries: Dict[str, int] = {}
    current = None
    for n, line in enumerate(NOT_PORTED.read_text().splitlines(), 1):
        head = re.match(r"^##\s+`?([\w]+\.py)`?\s*$", line)
        if head:
            current = head.group(1)
            continue
        if line.startswith("#"):
            current = None
            continue
        if current is None:  # the introduction
            continue
        for m in ENTRY.finditer(line):
            entries[f"{current}::{m.group(1)}"] = n
    return entries


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tf-src", type=Path, help="a TensorFlow source tree to check the manifests against")
    ap.add_argument("--write", action="store_true", help="with --tf-src: rewrite the manifests from the sources")
    args = ap.parse_args(argv)
    errors: List[str] = []
    if args.tf_src:
        for name in FILES:
            src = args.tf_src / TF_DIR / name
            methods = source_methods(src)
            if args.write:
                (MANIFESTS / (name[:-3] + ".txt")).write_text(
                    f"# {TF_DIR}/{name} (TensorFlow source tree {args.tf_src})\n" + "\n".join(methods) + "\n")
            elif set(methods) != set(read_manifest(name)):
                errors.append(f"manifest of {name} differs from {src}: "
                              f"missing {sorted(set(methods) - set(read_manifest(name)))}, "
                              f"extra {sorted(set(read_manifest(name)) - set(methods))}")
    marks = ported_marks()
    skipped = not_ported_entries()
    known: Set[str] = set()
    print(f"{'TF 2.21 file':42} {'methods':>7} {'ported':>7} {'not ported':>10}")
    totals = [0, 0, 0]
    for name in FILES:
        methods = read_manifest(name)
        if not methods:
            errors.append(f"no manifest for {name} (tests/tf_port/manifest/{name[:-3]}.txt)")
        ids = [f"{name}::{m}" for m in methods]
        known.update(ids)
        n_ported = sum(i in marks for i in ids)
        n_skipped = sum(i in skipped for i in ids)
        for i in ids:
            if i in marks and i in skipped:
                errors.append(f"{i} is both ported ({marks[i][0]}) and in NOT_PORTED.md:{skipped[i]}")
            elif i not in marks and i not in skipped:
                errors.append(f"{i} is neither ported nor listed in NOT_PORTED.md")
        totals = [totals[0] + len(ids), totals[1] + n_ported, totals[2] + n_skipped]
        print(f"{name:42} {len(ids):7} {n_ported:7} {n_skipped:10}")
    print(f"{'total':42} {totals[0]:7} {totals[1]:7} {totals[2]:10}")
    for i, where in sorted(marks.items()):
        if i not in known:
            errors.append(f"{where[0]}: tf_source({i!r}) names no method of the manifests")
    for i, line in sorted(skipped.items()):
        if i not in known:
            errors.append(f"NOT_PORTED.md:{line}: {i} names no method of the manifests")
    for e in errors:
        print("error:", e, file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
