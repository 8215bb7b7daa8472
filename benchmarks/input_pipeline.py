"""Input pipeline throughput and prefetch overlap.

    python benchmarks/input_pipeline.py [--ranks 1 2 4] [--global-batch 1024] [--repeats 3]

In one run (it starts ``mpiexec -n K`` itself for each K):

1. Examples/s per rank of reading ``.npy`` shards and TFRecord shards through
   ``DistributedDataset`` with FILE sharding (one local replica per rank, one
   step agreement per step), against a plain loop on every rank that
   ``np.load``s / parses the same files (worker w: files[w::W]) with no library,
   producing the same per-step batches. Best of ``--repeats`` alternated
   measurements, each of as many passes as make the plain loop last
   ``--min-seconds`` on the slowest rank.
   Target: mpistrat >= 0.9x the plain loop.
2. A step loop with simulated compute (sleep) on one rank: step time without
   prefetch (about input + compute) and with the default per-device prefetch
   (target <= 1.15 x max(compute, input)); compute is timed alone, as sleep
   overshoots its argument.

The machine's load changes these numbers: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

FEATURES = 64  # float32 per example (256 bytes)


# --------------------------------------------------------------------------- data
def make_data(root: str, shards: int, rows: int) -> None:
    import mpistrat.data as D

    rng = np.random.default_rng(0)
    for k in range(shards):
        x = rng.standard_normal((rows, FEATURES)).astype(np.float32)
        np.save(os.path.join(root, f"x-{k:03d}.npy"), x)
        with D.TFRecordWriter(os.path.join(root, f"x-{k:03d}.tfrecord")) as w:
            for row in x:
                w.write(row.tobytes())


def files(root: str, ext: str) -> list:
    return sorted(os.path.join(root, f) for f in os.listdir(root) if f.endswith(ext))


# --------------------------------------------------------------------------- plain loops
def plain_npy(my_files: list, local_batch: int) -> int:
    """np.load each file and hand out consecutive batches (views), carrying rows across files."""
    n = 0
    carry = None
    for f in my_files:
        a = np.load(f)
        if carry is not None:
            a = np.concatenate([carry, a])
        stop = len(a) - len(a) % local_batch
        for i in range(0, stop, local_batch):
            batch = a[i:i + local_batch]
            n += len(batch)
        carry = a[stop:]
    if carry is not None and len(carry):
        n += len(carry)
    return n


def plain_tfrecord(my_files: list, local_batch: int) -> int:
    """Parse TFRecord framing with CRC checks (google-crc32c) and decode batches with np.frombuffer."""
    import google_crc32c

    def masked(data: bytes) -> int:
        crc = google_crc32c.value(data)
        return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + 0xA282EAD8) & 0xFFFFFFFF

    n = 0
    records: list = []
    for f in my_files:
        with open(f, "rb") as fh:
            buf = fh.read()
        pos = 0
        while pos < len(buf):
            length, lcrc = struct.unpack_from("<QI", buf, pos)
            assert masked(buf[pos:pos + 8]) == lcrc
            data = buf[pos + 12:pos + 12 + length]
            (dcrc,) = struct.unpack_from("<I", buf, pos + 12 + length)
            assert masked(data) == dcrc
            records.append(data)
            pos += 16 + length
            if len(records) == local_batch:
                batch = np.frombuffer(b"".join(records), np.float32).reshape(len(records), FEATURES)
                n += len(batch)
                records = []
    if records:
        n += len(np.frombuffer(b"".join(records), np.float32).reshape(len(records), FEATURES))
    return n


# --------------------------------------------------------------------------- mpistrat
def decode_batch(records):
    return np.frombuffer(b"".join(records.tolist()), np.float32).reshape(len(records), FEATURES)


def mpistrat_run(dataset, info, options=None) -> int:
    from mpistrat.data.distribute import DistributedDataset

    n = 0
    for batch in DistributedDataset(dataset, info, options):
        n += len(batch)
    return n


def communicator(comm):
    try:
        from mpistrat.comm.communicator import RankCommunicator

        return RankCommunicator(comm)
    except ImportError:  # pragma: no cover - before the communicator landed
        class _C:
            def __init__(self, c):
                self.comm, self.rank, self.size = c, c.Get_rank(), c.Get_size()

            def step_agreement(self, code, options=None):
                return np.array(self.comm.allgather(int(code)), dtype=np.int64)

            def allgather_object(self, obj, options=None):
                return self.comm.allgather(obj)

            def broadcast_object(self, obj, root=0):
                return self.comm.bcast(obj, root=root)

        return _C(comm)


def worker(root: str, global_batch: int, repeats: int, min_seconds: float, out: str) -> None:
    from mpi4py import MPI

    import mpistrat.data as D
    from mpistrat.distribute.input_options import InputOptions, InputWorkerInfo

    comm = MPI.COMM_WORLD
    W, w = comm.Get_size(), comm.Get_rank()
    rc = communicator(comm) if W > 1 else None
    info = InputWorkerInfo(W, w, ("/cpu:0",), W, w, rc)
    local_batch = global_batch // W  # under FILE each rank's batch of B feeds W steps of B/W rows
    results = {}
    for kind, ext in (("npy", ".npy"), ("tfrecord", ".tfrecord")):
        all_files = files(root, ext)
        mine = all_files[w::W]
        if kind == "npy":
            dataset = D.NpyDataset(all_files).batch(global_batch)
            plain = lambda: plain_npy(mine, local_batch)  # noqa: E731
        else:
            dataset = D.TFRecordDataset(all_files).batch(global_batch).map(decode_batch)
            plain = lambda: plain_tfrecord(mine, local_batch)  # noqa: E731
        runs = {
            "plain": plain,
            "prefetch": lambda: mpistrat_run(dataset, info),  # default InputOptions: prefetch thread, buffer 1
            "prefetch16": lambda: mpistrat_run(dataset, info, InputOptions(experimental_per_replica_buffer_size=16)),
            "sync": lambda: mpistrat_run(dataset, info, InputOptions(experimental_per_replica_buffer_size=0)),
        }
        # Passes per measurement: enough for the slowest rank's plain loop to take min_seconds (one pass of
        # small shards lasts milliseconds, too short to time on a shared machine); the same on every rank.
        comm.Barrier()
        t0 = time.perf_counter()
        plain()
        passes = max(1, math.ceil(min_seconds / comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)))
        best = {k: float("inf") for k in runs}
        counts = {}
        for _ in range(repeats):
            for name, fn in runs.items():
                comm.Barrier()
                t0 = time.perf_counter()
                counts[name] = sum(fn() for _ in range(passes))
                best[name] = min(best[name], time.perf_counter() - t0)
        assert len(set(counts.values())) == 1, (kind, counts)
        rates = comm.gather({k: counts[k] / best[k] for k in best}, root=0)
        if w == 0:
            results[kind] = {k: [r[k] for r in rates] for k in best}
    if w == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    if rc is not None and hasattr(rc, "close"):
        rc.close()


# --------------------------------------------------------------------------- prefetch overlap
def prefetch_overlap(root: str, steps: int, batch: int, repeats: int) -> list:
    import mpistrat.data as D
    from mpistrat.data.distribute import DistributedDataset
    from mpistrat.distribute.input_options import InputOptions, InputWorkerInfo

    info = InputWorkerInfo.single(("/cpu:0",))
    # a per-record decode (Python work in the input pipeline) makes input cost real
    ds = (D.TFRecordDataset(files(root, ".tfrecord")).map(lambda r: np.frombuffer(r, np.float32))
          .batch(batch).take(steps))

    def run(buffer: int, compute: float) -> float:
        it = DistributedDataset(ds, info, InputOptions(experimental_per_replica_buffer_size=buffer))
        t0 = time.perf_counter()
        n = 0
        for _ in it:
            if compute:
                time.sleep(compute)
            n += 1
        return (time.perf_counter() - t0) / n

    def compute_only(compute: float) -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            time.sleep(compute)
        return (time.perf_counter() - t0) / steps

    run(0, 0.0)  # warm the page cache
    t_input = min(run(0, 0.0) for _ in range(repeats))
    rows = []
    for factor in (0.5, 1.0, 2.0):
        nominal = t_input * factor
        t_compute = min(compute_only(nominal) for _ in range(repeats))  # sleep overshoots a little
        serial = min(run(0, nominal) for _ in range(repeats))
        overlapped = min(run(1, nominal) for _ in range(repeats))
        rows.append({"input_ms": t_input * 1e3, "compute_ms": t_compute * 1e3, "no_prefetch_ms": serial * 1e3,
                     "prefetch_ms": overlapped * 1e3, "ratio": overlapped / max(t_compute, t_input)})
    return rows


# --------------------------------------------------------------------------- driver
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--global-batch", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--rows", type=int, default=32768, help="examples per shard")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.3, help="least duration of one throughput measurement")
    parser.add_argument("--prefetch-steps", type=int, default=60)
    parser.add_argument("--prefetch-batch", type=int, default=1024)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.global_batch, args.repeats, args.min_seconds, args.out)
        return

    root = tempfile.mkdtemp(prefix="mpistrat-input-bench-")
    try:
        make_data(root, args.shards, args.rows)
        mib = sum(os.path.getsize(f) for f in files(root, ".npy")) / 2**20
        print(f"data: {args.shards} shards x {args.rows} examples x {FEATURES} float32 ({mib:.0f} MiB as .npy, "
              f"same examples as TFRecord); global batch {args.global_batch}; FILE sharding; best of {args.repeats} "
              f"alternated measurements of >= {args.min_seconds} s each")
        mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or "mpiexec"
        print("ex/s per rank (mean over ranks); ratio = mpistrat / plain (worst rank in brackets)")
        print("columns: plain loop; mpistrat with default InputOptions (prefetch thread, buffer 1); with buffer 16;")
        print("with buffer 0 (no thread: host read-ahead, agreement amortised over up to 64 steps)")
        print(f"{'source':9} {'ranks':>5} {'plain':>11} {'buffer 1':>12} {'ratio':>12} {'buffer 16':>12} {'ratio':>12} "
              f"{'buffer 0':>12} {'ratio':>12}")
        for k in args.ranks:
            out = os.path.join(root, f"result-{k}.json")
            cmd = [mpiexec, "-n", str(k), sys.executable, os.path.abspath(__file__), "--worker", root, "--out", out,
                   "--global-batch", str(args.global_batch), "--repeats", str(args.repeats),
                   "--min-seconds", str(args.min_seconds)]
            subprocess.run(cmd, check=True, timeout=600)
            with open(out) as f:
                res = json.load(f)
            for kind in ("npy", "tfrecord"):
                r = res[kind]
                plain = np.array(r["plain"])
                cells = []
                for mode in ("prefetch", "prefetch16", "sync"):
                    lib = np.array(r[mode])
                    cells.append(f"{lib.mean():>12,.0f} {lib.mean() / plain.mean():>5.2f} ({(lib / plain).min():.2f})")
                print(f"{kind:9} {k:>5} {plain.mean():>11,.0f} " + " ".join(cells))
        print()
        print(f"prefetch (1 rank, default InputOptions: thread, per-replica buffer 1; input = TFRecord read + per-record "
              f"decode + batch {args.prefetch_batch}; compute = sleep, measured alone; best of {args.repeats}):")
        print(f"{'input ms':>9} {'compute ms':>11} {'no prefetch ms':>15} {'prefetch ms':>12} {'/ max(c,i)':>11}")
        for row in prefetch_overlap(root, args.prefetch_steps, args.prefetch_batch, args.repeats):
            print(f"{row['input_ms']:>9.2f} {row['compute_ms']:>11.2f} {row['no_prefetch_ms']:>15.2f} "
                  f"{row['prefetch_ms']:>12.2f} {row['ratio']:>11.2f}")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
