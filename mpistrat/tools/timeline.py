"""``python -m mpistrat timeline``: merge the per-rank files a job left, and summarise a trace per rank.

    python -m mpistrat timeline merge trace.json.rank*.jsonl -o trace.json
    python -m mpistrat timeline summary trace.json

``merge`` takes what each rank streamed (``MPISTRAT_TIMELINE=trace.json`` writes
``trace.json.rank<R>.jsonl``), also after a job was killed, and writes one Chrome trace.
``summary`` prints, per rank, the time in steps (``strategy.run``), in collectives, waiting for
peers (the collectives' agreement wait) and waiting for input: the straggler at a glance.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from typing import Any

from mpistrat import timeline

__all__ = ["add_arguments", "run", "summarize", "format_summary"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``merge`` and ``summary`` subcommands."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    merge = sub.add_parser("merge", help="merge per-rank .jsonl files into one Chrome trace")
    merge.add_argument("files", nargs="+", help="the ranks' files (trace.json.rank<R>.jsonl)")
    merge.add_argument("-o", "--output", required=True, help="the merged trace to write")
    summary = sub.add_parser("summary", help="per rank: time in steps, collectives, waiting for peers and input")
    summary.add_argument("trace", help="a merged trace (JSON) or one rank's .jsonl file")


def summarize(events: list[dict]) -> dict[int, dict[str, float]]:
    """Per rank (pid): seconds in steps, collectives, waiting for peers, waiting for input, and the step count."""
    rows: dict[int, dict[str, float]] = defaultdict(lambda: {"steps": 0, "step_s": 0.0, "collective_s": 0.0,
                                                             "peer_wait_s": 0.0, "input_wait_s": 0.0})
    for e in events:
        if e.get("ph") != "X":
            continue
        row, seconds, cat = rows[int(e.get("pid", 0))], float(e.get("dur", 0.0)) / 1e6, e.get("cat")
        if cat == "step":
            row["steps"] += 1
            row["step_s"] += seconds
        elif cat == "collective":
            row["collective_s"] += seconds
            row["peer_wait_s"] += float(e.get("args", {}).get("wait_us", 0.0)) / 1e6
        elif cat == "input":
            row["input_wait_s"] += seconds
    return dict(sorted(rows.items()))


def format_summary(rows: dict[int, dict[str, float]]) -> str:
    """The table ``summary`` prints."""
    lines = [f"{'rank':>4} {'steps':>7} {'in steps s':>11} {'collectives s':>14} {'peer wait s':>12} "
             f"{'input wait s':>13}"]
    for rank, r in rows.items():
        lines.append(f"{rank:>4} {int(r['steps']):>7} {r['step_s']:>11.3f} {r['collective_s']:>14.3f} "
                     f"{r['peer_wait_s']:>12.3f} {r['input_wait_s']:>13.3f}")
    return "\n".join(lines)


def _load(path: str) -> list[dict]:
    if path.endswith(".jsonl"):
        return timeline.read_events(path)
    with open(path, encoding="utf-8") as fh:
        document: Any = json.load(fh)
    return document["traceEvents"] if isinstance(document, dict) else document


def run(args: argparse.Namespace) -> int:
    """Run the chosen action; 0 on success."""
    if args.action == "merge":
        document = timeline.merge_files(args.output, list(args.files), complete=True, remove=False)
        missing = document["otherData"]["missing_rank_files"]
        print(f"{len(document['traceEvents'])} events from {len(args.files) - len(missing)} files -> {args.output}")
        for f in missing:
            print(f"missing: {f}", file=sys.stderr)
        return 1 if missing else 0
    print(format_summary(summarize(_load(args.trace))))
    return 0
