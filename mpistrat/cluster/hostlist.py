"""Slurm's compressed list formats (host lists, tasks-per-node lists), expanded.

Short, pure-Python functions with no dependency; the results are checked
against Slurm's own ``scontrol show hostnames`` in the Slurm tests.
"""

from __future__ import annotations

import itertools
import re

__all__ = ["expand_hostlist", "expand_tasks_per_node"]

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def _split_top_level(text: str, what: str, original: str) -> list[str]:
    """Split at commas that are outside brackets."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            if depth:
                raise ValueError(f"Invalid {what} {original!r}: nested '['")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"Invalid {what} {original!r}: ']' without '['")
            depth = 0
        elif ch == "," and not depth:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    if depth:
        raise ValueError(f"Invalid {what} {original!r}: '[' is never closed")
    parts.append("".join(current))
    if any(not p.strip() for p in parts):
        raise ValueError(f"Invalid {what} {original!r}: empty entry")
    return [p.strip() for p in parts]


def _expand_range(body: str, original: str) -> list[str]:
    """``"3-5,7"`` -> ``["3", "4", "5", "7"]`` keeping the width of the first bound."""
    values: list[str] = []
    for item in body.split(","):
        m = _RANGE_RE.match(item.strip())
        if not m:
            raise ValueError(f"Invalid hostlist {original!r}: bad range {item!r} in [{body}]")
        lo_text, hi_text = m.group(1), m.group(2) or m.group(1)
        lo, hi = int(lo_text), int(hi_text)
        if hi < lo:
            raise ValueError(f"Invalid hostlist {original!r}: range {item!r} goes backwards")
        width = len(lo_text) if lo_text.startswith("0") and len(lo_text) > 1 else 0
        values.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return values


def _expand_name(name: str, original: str) -> list[str]:
    """One host expression (no top-level comma) -> host names."""
    pieces = re.split(r"(\[[^\]]*\])", name)
    choices = []
    for piece in pieces:
        if piece.startswith("["):
            body = piece[1:-1]
            if not body:
                raise ValueError(f"Invalid hostlist {original!r}: empty brackets")
            choices.append(_expand_range(body, original))
        elif piece:
            choices.append([piece])
    return ["".join(combo) for combo in itertools.product(*choices)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list (``SLURM_STEP_NODELIST``) into host names.

    ``expand_hostlist("n[1-2],m5,o[3-4,6,7-9]")`` gives
    ``["n1", "n2", "m5", "o3", "o4", "o6", "o7", "o8", "o9"]``: order is kept,
    duplicates are kept, zero padding follows the first bound (``n[001-3]``
    gives ``n001, n002, n003``), and several bracket groups in one name expand
    as Slurm does (``r[1-2]n[1-2]`` gives ``r1n1, r1n2, r2n1, r2n2``). Text
    after a bracket (``gpu[1-2]-ib``) is accepted as python-hostlist reads it,
    although Slurm 22.05's ``scontrol`` rejects it.
    """
    if not isinstance(hostlist, str):
        raise TypeError(f"A hostlist must be a string, got {type(hostlist).__name__}")
    text = hostlist.strip()
    if not text:
        raise ValueError("Invalid hostlist '': it is empty")
    hosts: list[str] = []
    for part in _split_top_level(text, "hostlist", hostlist):
        hosts.extend(_expand_name(part, hostlist))
    return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expand a Slurm tasks-per-node list: ``"3(x2),2,1"`` -> ``[3, 3, 2, 1]``."""
    if not isinstance(tasks_per_node, str):
        raise TypeError(f"A tasks-per-node list must be a string, got {type(tasks_per_node).__name__}")
    result: list[int] = []
    for part in tasks_per_node.split(","):
        m = _TASKS_RE.match(part.strip())
        if not m:
            raise ValueError(
                f"Invalid tasks-per-node list {tasks_per_node!r}: cannot read {part!r} "
                "(expected entries like '2' or '2(x3)')"
            )
        result.extend([int(m.group(1))] * int(m.group(2) or 1))
    return result
