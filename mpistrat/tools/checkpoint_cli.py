"""``python -m mpistrat checkpoint``: list what a checkpoint holds, or export it for other tools."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from mpistrat.train.checkpoint_file import CheckpointError, read_manifest, read_saved

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``checkpoint``."""
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    inspect = sub.add_parser("inspect", help="list the variables (name, shape, dtype) and the metadata")
    inspect.add_argument("path", help="a checkpoint file (.npz)")
    inspect.add_argument("--json", action="store_true", help="print JSON instead of a table")
    export = sub.add_parser("export", help="write the variables in another format")
    export.add_argument("path", help="a checkpoint file (.npz)")
    export.add_argument("--format", choices=["safetensors"], default="safetensors")
    export.add_argument("-o", "--output", required=True, help="the file to write")


def _inspect(args: argparse.Namespace) -> int:
    manifest = read_manifest(args.path)
    rows = [(e["name"], tuple(e["shape"]), np.dtype(e["dtype"]).name) for e in manifest["variables"]]
    if args.json:
        print(json.dumps({"version": manifest["version"], "metadata": manifest["metadata"],
                          "variables": [{"name": n, "shape": list(s), "dtype": d} for n, s, d in rows]}, indent=1))
        return 0
    width = max([len(n) for n, _, _ in rows] + [4])
    print(f"{args.path}: {len(rows)} variables (format version {manifest['version']})")
    print(f"{'name':<{width}}  {'shape':<16} dtype")
    for name, shape, dtype in rows:
        print(f"{name:<{width}}  {str(shape):<16} {dtype}")
    if manifest["metadata"]:
        print(f"metadata: {json.dumps(manifest['metadata'])}")
    return 0


def _export(args: argparse.Namespace) -> int:
    try:
        from safetensors.numpy import save_file  # noqa: PLC0415
    except ImportError:
        print("python -m mpistrat checkpoint export --format safetensors needs the safetensors package: "
              "pip install -e '.[safetensors]' (or pip install safetensors)", file=sys.stderr)
        return 1
    manifest, arrays = read_saved(args.path)
    metadata = {"format": "mpistrat-checkpoint", "source": os.path.basename(args.path),
                "metadata": json.dumps(manifest["metadata"])}
    save_file({name: np.array(a, order="C") for name, a in arrays.items()}, args.output, metadata=metadata)
    print(f"wrote {len(arrays)} variables to {args.output} (safetensors)")
    return 0


def run(args: argparse.Namespace) -> int:
    """Run ``checkpoint inspect|export``; a checkpoint that does not read gives its error and exit status 1."""
    try:
        return _inspect(args) if args.action == "inspect" else _export(args)
    except CheckpointError as exc:
        print(f"python -m mpistrat checkpoint: {exc}", file=sys.stderr)
        return 1
