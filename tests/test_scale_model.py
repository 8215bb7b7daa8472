"""benchmarks/scale_model.py's model: the fit, the algorithm forms, the data file and the command line (one test
runs --measure under mpiexec)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

import pytest

_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "scale_model.py")
_spec = importlib.util.spec_from_file_location("scale_model", _PATH)
sm = importlib.util.module_from_spec(_spec)
sys.modules["scale_model"] = sm  # dataclasses look their module up
_spec.loader.exec_module(sm)

NET = sm.Network(latency=1.2e-6, bandwidth=24e9)


def _probe_times(sizes: list[int]) -> tuple[list[float], list[float], list[float | None]]:
    """Probes whose per-byte cost rises with the working set, as caches run out (seconds)."""
    shm = [n * (0.03e-9 + 0.12e-9 * n / (n + (8 << 20))) for n in sizes]
    private = [n * (0.02e-9 + 0.08e-9 * n / (n + (16 << 20))) for n in sizes]
    fault = [n / sm.PAGE * 0.25e-6 if n <= sm.FIT_MAX else None for n in sizes]
    return shm, private, fault


def _run(truth: sm.Model | None, ranks: int, nodes: int, cores: int, sizes: list[int]) -> dict:
    """A layout's run as ``load_data`` gives it: one sweep, and its times as ``time_s``."""
    shm, private, fault = _probe_times(sizes)
    run = {"ranks": ranks, "nodes": nodes, "local": ranks // nodes, "pretend": nodes > 1, "machine_ranks": ranks,
           "cores": cores, "sizes": sizes,
           "time_s": {"shm_pass": shm, "private_pass": private, "fault": fault}, "fault_probe": sm.FAULT_PROBE,
           "measured": sm.MEASURED}
    if truth is not None:
        for path in sm.PATHS:
            run["time_s"][path] = [truth.measured_layout(path, n, ranks, nodes, cores) for n in sizes]
        # After the sweeps, up to 1 MiB: Allreduce of shared memory, slower than of private memory here, and
        # Iallreduce of it polled by the library's waiter, beside it: the same and the wait's cost per call.
        wait = truth.waited(max(1, ranks // cores), cores, stride=1)
        beside = [1.1 * t if n <= sm.FIT_MAX else None for n, t in zip(sizes, run["time_s"]["mpi"])]
        run["time_s"][sm.WAIT_REFERENCE] = beside
        run["time_s"][sm.WAITED] = [None if t is None else t + wait for t in beside]
    run["sweeps_s"] = {name: [[] if t is None else [t] for t in times] for name, times in run["time_s"].items()}
    return run


def _truth() -> sm.Model:
    machine = sm.Machine.from_run(_run(None, 2, 1, 2, sm.SIZES), constant=False)
    return sm.Model(machine, a_window=3e-6, b_window=0.1e-9, a_mpi=2.5e-6, b_mpi=0.25e-9, a_eager=1.5e-6,
                    a_window_core=20e-6, b_window_core=0.13e-9, a_core=9e-6, b_core=0.4e-9, a_core_eager=6e-6,
                    wait=1e-6, wait_core=12e-6)


CORE_FIELDS = ("a_window_core", "b_window_core", "wait_core", "a_core", "b_core", "a_core_eager")


def _data(truth: sm.Model) -> dict:
    layouts = {sm.FIT_LAYOUT: (2, 1, 2), "4 ranks, 1 node": (4, 1, 2), "4 ranks, 2 pretend nodes": (4, 2, 2),
               sm.SAME_CORE_LAYOUT: (2, 1, 1)}
    return {"format": 1, "runs": {key: _run(truth, r, k, c, sm.SIZES) for key, (r, k, c) in layouts.items()}}


def test_the_fit_recovers_the_parameters_the_times_came_from():
    truth = _truth()
    runs = _data(truth)["runs"]
    fitted = sm.fit(runs[sm.FIT_LAYOUT], constant=False, core_run=runs[sm.SAME_CORE_LAYOUT])
    for name in ("a_window", "b_window", "a_mpi", "b_mpi", "a_eager", "wait") + CORE_FIELDS:
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert fitted.machine.fault == pytest.approx(0.25e-6 / sm.PAGE)
    alone = sm.fit(runs[sm.FIT_LAYOUT], constant=False)  # without the same-core run: nothing of it
    assert all(getattr(alone, name) is None for name in CORE_FIELDS)
    with pytest.raises(ValueError, match="the '2 ranks, 1 node, one core' run"):
        alone.measured_layout("window", 1 << 20, 4, 1, 2)
    with pytest.raises(ValueError, match="the '2 ranks, 1 node, one core' run"):
        alone.measured_layout("mpi", 1 << 20, 4, 1, 2)


def test_the_fit_uses_nothing_above_one_mebibyte():
    run = _data(_truth())["runs"][sm.FIT_LAYOUT]
    before = sm.fit(run, constant=False)
    for path in sm.PATHS:  # held-out sizes changed beyond recognition
        run["time_s"][path] = [t if n <= sm.FIT_MAX else 1e3 * t for n, t in zip(run["sizes"], run["time_s"][path])]
    after = sm.fit(run, constant=False)
    assert (after.a_window, after.b_window, after.a_mpi, after.b_mpi, after.a_eager) == (
        before.a_window, before.b_window, before.a_mpi, before.b_mpi, before.a_eager)


def test_the_mpi_line_is_fitted_from_the_first_judged_size():
    run = _data(_truth())["runs"][sm.FIT_LAYOUT]
    before = sm.fit(run, constant=False)
    below = [i for i, n in enumerate(run["sizes"]) if n / 2 >= sm.MPICH_CMA_MIN and n < sm.MPI_LINE_MIN]
    assert [run["sizes"][i] for i in below] == [16 << 10, 32 << 10]  # kernel copies, below the line's sizes
    for i in below:
        run["time_s"]["mpi"][i] *= 0.5
    after = sm.fit(run, constant=False)
    assert (after.a_mpi, after.b_mpi, after.a_eager) == (before.a_mpi, before.b_mpi, before.a_eager)
    run["time_s"]["mpi"][run["sizes"].index(sm.MPI_LINE_MIN)] *= 0.5  # the line's first size does count
    assert sm.fit(run, constant=False).a_mpi != pytest.approx(before.a_mpi, rel=1e-3)
    # the same-core run's line likewise
    runs = _data(_truth())["runs"]
    core = runs[sm.SAME_CORE_LAYOUT]
    before = sm.fit(runs[sm.FIT_LAYOUT], constant=False, core_run=core)
    for i in below:
        core["time_s"]["mpi"][i] *= 0.5
    after = sm.fit(runs[sm.FIT_LAYOUT], constant=False, core_run=core)
    assert (after.a_core, after.b_core, after.a_core_eager) == (before.a_core, before.b_core, before.a_core_eager)


def test_exact_times_give_zero_errors_on_every_held_out_layout():
    truth = _truth()
    data = _data(truth)
    models = sm.fit_all(data["runs"])
    found = sm.checks(data, models)
    layouts = {c.layout for c in found if not c.fitted}
    assert layouts == set(data["runs"]) - {sm.SAME_CORE_LAYOUT}  # a fit input, like the probes
    memory = [abs(c.errors()[1]) for c in found]
    assert max(memory) < 1e-6
    # The constant-cost variant cannot follow the probes' rise with the working set.
    assert max(abs(c.errors()[0]) for c in found if c.size >= 16 << 20) > sm.TARGET


def test_the_fit_never_returns_negative_parameters():
    run = _data(_truth())["runs"][sm.FIT_LAYOUT]
    run["time_s"]["window"] = [1e-9 * n for n in run["sizes"]]  # no latency at all, and more
    model = sm.fit(run, constant=False)
    assert model.a_window >= 0 and model.b_window >= 0


def test_mpi_follows_reduce_scatter_allgather():
    model = _truth()
    n, ws = float(1 << 20), float(64 << 20)
    sum_per_byte = 2 * (model.machine.pass_cost("private", 2 * sm.FIT_MAX) + model.machine.extra("private", ws))
    assert model.machine.extra("private", ws) > 0  # beyond the fit's working set

    def step(x: float) -> float:  # copied in the kernel from 4 KiB pages: grows as a pass over 2 x bytes
        return model.a_mpi + model.b_mpi * x + 2 * model.machine.extra("private", ws) * x

    expected = 2 * step(n / 2) + n / 2 * sum_per_byte + 2 * step(n / 4) + n / 4 * sum_per_byte
    assert model.mpi_machine(n, 4, ws) == pytest.approx(expected)
    assert model.mpi_machine(n, 1, ws) == 0.0


def test_per_byte_costs_grow_only_beyond_the_fit():
    variable = _truth().machine
    constant = sm.Machine.from_run(_run(None, 2, 1, 2, sm.SIZES), constant=True)
    for kind in ("shm", "private"):
        assert variable.extra(kind, 2 * sm.FIT_MAX) == 0.0
        assert variable.extra(kind, 4096) == 0.0  # small passes' per-call overhead is no growth
        # Beyond the fit: what the probe's pass costs more per byte there, added (not a ratio).
        assert variable.extra(kind, 128 << 20) == pytest.approx(
            variable.pass_cost(kind, 128 << 20) - variable.pass_cost(kind, 2 * sm.FIT_MAX))
        assert variable.extra(kind, 128 << 20) > 0.5 * variable.pass_cost(kind, 2 * sm.FIT_MAX)
        assert constant.extra(kind, 128 << 20) == 0.0


def _plan_writes(local: int, local_rank: int, one_node: bool, count: int = 24 << 10) -> float:
    """Items the real reduce plan of ``local_rank`` writes (sums, copies back, pushes in the blocks or, across
    nodes, after the cross-node all-reduce), per item of the bucket; it sums aside where the transport's own
    rule (``sums_aside``) says so."""
    import numpy as np

    from mpistrat.comm.transport.shm.plan import make_plan, sums_aside

    views = [np.zeros(count, np.float32) for _ in range(local)]
    bounds = [count * i // local for i in range(local + 1)]
    step = 1 << 10
    tmp = np.zeros(step, np.float32) if sums_aside(local, local_rank, local) else None
    plan = make_plan(views, bounds, local_rank, local, one_node, step, tmp)
    written = sum(t.size for t in plan.cross_targets)
    for srcs, dst, back, targets, _, _ in plan.blocks:
        written += (len(srcs) - 1) * dst.size  # the first sum writes dst, each later one again
        written += (0 if back is None else back.size) + sum(t.size for t in targets)
    return written / count


@pytest.mark.parametrize("one_node", [True, False])
@pytest.mark.parametrize("local", [2, 3, 4, 8])
def test_window_writes_counts_what_the_reduce_plan_writes(local, one_node):
    for local_rank in range(local):
        assert sm.window_writes(local, local_rank) == pytest.approx(
            _plan_writes(local, local_rank, one_node)), local_rank
    assert sm.window_writes(1, 0) == 0.0


def test_a_core_writes_what_its_ranks_write_one_after_the_other():
    # 4 ranks on 2 cores, rank r on core r % 2: ranks 0 and 2 (1.5 and 1.75 bytes per byte) share core 0.
    assert sm.core_load(4, 4, 2) == pytest.approx(1.5 + 1.75)
    assert sm.core_load(2, 4, 2) == 2.0  # 2 pretend nodes of 2: a byte per byte per rank, two per core
    assert sm.core_load(4, 4, 4) == 1.75  # a core each: the slowest rank
    assert sm.core_load(2, 2, 1) == 2.0  # both ranks on one core


def test_mpich_scratch_buffer_faults_only_from_glibc_mmap_maximum():
    model = _truth()
    below, above = sm.GLIBC_MMAP_THRESHOLD_MAX - sm.PAGE, sm.GLIBC_MMAP_THRESHOLD_MAX
    assert model.faults(below, 2) == 0.0
    assert model.faults(above, 2) == pytest.approx(model.machine.fault * above / 2)


def test_mpich_scratch_buffer_touches_half_the_array_whatever_the_ranks():
    # Recursive halving receives n/2 into the scratch buffer, then each step into part of the last region.
    model = _truth()
    n = 64 << 20
    assert model.faults(n, 2) == model.faults(n, 4) == model.faults(n, 1024) > 0
    assert model.faults(n, 1) == 0.0


def test_mpi_steps_below_the_kernel_copy_threshold_take_the_shorter_latency():
    model = _truth()
    below, at = sm.MPICH_CMA_MIN - 4, sm.MPICH_CMA_MIN
    assert model.mpi_step(below, 0) == pytest.approx(model.a_eager + model.b_mpi * below)
    assert model.mpi_step(at, 0) == pytest.approx(model.a_mpi + model.b_mpi * at)
    model.a_eager = None  # one latency for every step
    assert model.mpi_step(below, 0) == pytest.approx(model.a_mpi + model.b_mpi * below)


def test_ranks_sharing_cores_run_one_after_the_other_and_hand_the_core_over_in_each_sync():
    model = _truth()
    n, ws = 4 << 20, 16 << 20  # 4 ranks: ws = 4 n
    byte = model.b_window + model.machine.extra("shm", ws)
    assert model.window_byte(ws) == pytest.approx(byte) and byte > model.b_window
    # Sharing a core and running beyond the fit both lose cache: the larger loss counts, once.
    loss = max(model.b_window_core - model.b_window, model.machine.extra("shm", ws))
    shared = model.b_window + loss
    assert model.window_byte(ws, shared_core=True) == pytest.approx(shared) and shared >= byte
    small = float(sm.FIT_MAX)  # within the fit's working set: the same-core run's cost per byte
    assert model.window_byte(small, shared_core=True) == pytest.approx(model.b_window_core)
    assert model.window_byte(small) == pytest.approx(model.b_window) and model.b_window < model.b_window_core
    big = float(1 << 30)  # far beyond: the probe's extra outgrows what sharing a core costs
    assert model.machine.extra("shm", big) > model.b_window_core - model.b_window
    assert model.window_byte(big, shared_core=True) == pytest.approx(model.window_byte(big))
    assert model.measured_layout("window", n, 4, 1, 4) == pytest.approx(2 * model.a_window + 1.75 * byte * n)
    # Ranks that share a core share its caches: their costs grow at twice the machine's working set.
    assert (sm.layout_ws(n, 4, 4), sm.layout_ws(n, 4, 2), sm.layout_ws(n, 2, 1)) == (ws, 2 * ws, 4 * n)
    assert model.window_byte(2 * ws, shared_core=True) > shared
    assert model.measured_layout("window", n, 4, 1, 2) == pytest.approx(
        2 * (model.a_window + model.a_window_core) + (1.5 + 1.75) * model.window_byte(2 * ws, shared_core=True) * n)
    assert model.measured_layout("window", n, 2, 1, 1) == pytest.approx(  # one core: no cross-core part
        2 * model.a_window_core + 2 * model.window_byte(4 * n, shared_core=True) * n)
    without = sm.Model(model.machine, 3e-6, 0.1e-9, 2.5e-6, 0.25e-9, a_window_core=20e-6)
    with pytest.raises(ValueError, match="one core"):
        without.measured_layout("window", n, 4, 1, 2)


def test_mpi_steps_between_ranks_of_one_core_take_the_same_core_step():
    # 4 ranks on 2 cores, rank r on core r % 2: step 1 pairs ranks 1 apart (two cores, each core copying
    # for its two ranks), step 2 ranks 2 apart (one core, one pair on each).
    model = _truth()
    n = 1 << 20
    machine = 4 * n  # MPI's copies and sums grow at the machine's working set, even where ranks share a core
    grow = model.copy_growth("private", machine)  # each core copies for both its ranks, on either kind of step
    assert model.mpi_step(n / 2, machine) == pytest.approx(model.a_mpi + (model.b_mpi + grow) * n / 2)
    expected = (2 * 2 * model.mpi_step(n / 2, machine) + 2 * (model.core_step(n / 4) + 2 * grow * n / 4)
                + 2 * (model.reduce(n / 2, machine) + model.reduce(n / 4, machine)) + 2 * model.faults(n, 4))
    assert 0 < grow < model.copy_growth("private", 2 * machine)  # at layout_ws it would be more
    assert model.measured_layout("mpi", n, 4, 1, 2) == pytest.approx(expected)
    ws = sm.layout_ws(n, 4, 2)  # 8 n: work on window memory, each core's caches shared by two ranks
    assert model.core_step(sm.MPICH_CMA_MIN) == pytest.approx(model.a_core + model.b_core * sm.MPICH_CMA_MIN)
    assert model.core_step(1024) == pytest.approx(model.a_core_eager + model.b_core * 1024)
    # On pretend nodes the slice owners 2 ranks apart, both on one core, all-reduce across the nodes;
    # each node's plan is two ranks', a byte written per byte each.
    node = 2 * (model.a_window + model.a_window_core) + 2 * model.window_byte(ws, shared_core=True) * n
    cross = (2 * (model.core_step(n / 4) + 2 * model.copy_growth("shm", ws / 2) * n / 4)
             + 2 * model.reduce(n / 4, ws / 2, "shm"))  # copies and sums on window memory
    # each pair completes its Iallreduce with the library's waiter, on its one core: the same-core run's wait
    assert model.measured_layout("window", n, 4, 2, 2) == pytest.approx(node + cross + model.wait_core)
    big = 64 << 20  # MPICH's scratch buffer faults in on both ranks of each core
    ws = 2 * big
    assert model.mpi_machine(big, 2, ws, per_core=2, cores=1) == pytest.approx(
        2 * (model.core_step(big / 2) + 2 * model.copy_growth("private", ws) * big / 2)
        + 2 * model.reduce(big / 2, ws) + 2 * model.faults(big, 2))
    assert model.measured_layout("mpi", big, 2, 1, 1) == pytest.approx(
        model.mpi_machine(big, 2, ws, per_core=2, cores=1))
    # The fit's rest is what mpi_machine adds beyond the two line steps, on either core count.
    for size in (64 << 10, 1 << 20, big):
        assert model.measured_layout("mpi", size, 2, 1, 2) == pytest.approx(
            2 * sm._message_step(size / 2, model.a_mpi, model.a_eager, model.b_mpi) + model.mpi_rest(size, cores=2))
        assert model.measured_layout("mpi", size, 2, 1, 1) == pytest.approx(
            2 * model.core_step(size / 2) + model.mpi_rest(size, cores=1))
    with pytest.raises(ValueError, match="1 or 2 cores"):
        model.mpi_rest(big, cores=4)


def test_pretend_nodes_add_the_owners_cross_node_all_reduce():
    model = _truth()
    n, ws = 1 << 20, 4 << 20
    nodes = 2 * model.a_window + model.window_byte(ws) * n  # a core each, two ranks per node: a byte per byte
    cross = model.mpi_machine(n / 2, 2, ws / 2, memory="shm")
    assert model.measured_layout("window", n, 4, 2, 4) == pytest.approx(nodes + cross + model.wait)
    assert cross > model.mpi_machine(n / 2, 2, ws / 2)  # the window's pages: the shm probe's dearer pass


def test_copies_grow_beyond_the_fit_as_a_pass_over_their_memory():
    model = _truth()
    ws = float(64 << 20)
    for memory in ("shm", "private"):  # all on 4 KiB pages (private_region)
        assert model.copy_growth(memory, 2 * sm.FIT_MAX) == 0.0  # within the fit's working set
        assert model.copy_growth(memory, ws) == pytest.approx(2 * model.machine.extra(memory, ws))
        assert model.copy_growth(memory, ws) > 0.0
    # The owners' all-reduce of 4 ranks on 2 pretend nodes: one same-core step each way of n / 4, its
    # copies of window memory grown at the owners' working set.
    n = float(16 << 20)
    x, owners_ws = n / 4, 2 * n
    growth = model.copy_growth("shm", owners_ws) * x  # per copy; the core copies for both of its ranks
    expected = (2 * (model.core_step(x) + 2 * growth) + 2 * model.reduce(x, owners_ws, "shm")
                + 2 * model.faults(n / 2, 2))
    assert model.mpi_machine(n / 2, 2, owners_ws, per_core=2, cores=2, stride=2, memory="shm") == pytest.approx(
        expected)
    # A core per rank (the pretend nodes' owners on two cores): each rank's copy grows the same.
    assert model.mpi_machine(n / 2, 2, owners_ws, memory="shm") == pytest.approx(
        2 * model.mpi_step(x, owners_ws, "shm") + model.reduce(x, owners_ws, "shm") + model.faults(n / 2, 2))
    assert model.mpi_step(x, owners_ws, "shm") == pytest.approx(model.a_mpi + model.b_mpi * x + growth)
    assert model.measured_layout("window", n, 4, 2, 4) == pytest.approx(
        2 * model.a_window + model.window_byte(4 * n) * n + model.mpi_machine(n / 2, 2, owners_ws, memory="shm")
        + model.wait)
    assert model.mpi_machine(n, 2, 2 * n) == pytest.approx(  # private arrays: their own probe's growth
        2 * (model.a_mpi + (model.b_mpi + model.copy_growth("private", 2 * n)) * n / 2) + model.reduce(n / 2, 2 * n)
        + model.faults(n, 2))
    constant = sm.Model(sm.Machine.from_run(_run(None, 2, 1, 2, sm.SIZES), constant=True), 3e-6, 0.1e-9,
                        2.5e-6, 0.25e-9)
    assert constant.copy_growth("shm", ws) == 0.0


def test_sums_cost_the_probe_pass_of_their_memory():
    model = _truth()
    x, ws = float(4 << 20), float(64 << 20)
    for memory in ("private", "shm"):
        per_byte = model.machine.pass_cost(memory, 2 * sm.FIT_MAX) + model.machine.extra(memory, ws)
        assert model.reduce(x, ws, memory) == pytest.approx(2 * x * per_byte)
    assert model.reduce(x, ws) == model.reduce(x, ws, "private")


def test_hierarchical_is_flat_with_one_rank_per_node_and_the_window_on_one_node():
    model = _truth()
    for n in (64 << 10, 1 << 20, 64 << 20):
        assert model.hierarchical(n, 64, 1, NET) == model.flat(n, 64, 1, NET)
        assert model.hierarchical(n, 8, 8, NET) == pytest.approx(model.window_node(n, 8, 8 * n))
        assert model.window_node(n, 8, 8 * n) == pytest.approx(  # the slowest rank: local rank 2 and up
            2 * model.a_window + sm.window_writes(8, 7) * model.window_byte(8 * n) * n)
        assert model.flat(n, 8, 8, NET) == pytest.approx(model.mpi_machine(n, 8, 8 * n))


def test_cross_node_traffic_follows_the_network_parameters():
    model = _truth()
    slow = sm.Network(latency=NET.latency, bandwidth=NET.bandwidth / 10)
    for n in (64 << 10, 16 << 20):
        for per_node in (1, 4):
            assert model.flat(n, 256, per_node, slow) > model.flat(n, 256, per_node, NET)
        assert model.hierarchical(n, 256, 4, slow) > model.hierarchical(n, 256, 4, NET)
    # Both paths put 2 n (1 - per_node / ranks) bytes per node on the link at large sizes.
    n, ranks, per_node = 64 << 20, 1024, 8
    link = 2 * n * (1 - per_node / ranks) / NET.bandwidth
    assert model.flat(n, ranks, per_node, NET) > link
    assert model.hierarchical(n, ranks, per_node, NET) > link


def test_the_flat_path_s_steps_within_a_node_grow_as_every_mpi_copy_does():
    class NoGrowth(sm.Model):
        def copy_growth(self, memory: str, ws: float) -> float:
            return 0.0

    model = _truth()
    flat = NoGrowth(**{f.name: getattr(model, f.name) for f in dataclasses.fields(model)})
    n, ranks, per_node = float(16 << 20), 64, 8  # above MPICH's composition: its first log2(8) steps in the node
    ws = per_node * n
    grown = sum(2 * model.copy_growth("private", ws) * n / 2**k for k in range(1, 4))
    assert grown > 0
    assert model.flat(n, ranks, per_node, NET) == pytest.approx(flat.flat(n, ranks, per_node, NET) + grown)


def test_small_messages_across_nodes_take_mpich_composition():
    model = _truth()
    n, ranks, per_node = 16 << 10, 64, 4
    ws = per_node * n
    leaders = model.net_allreduce(n, ranks // per_node, 1, ws, NET, sm.MPICH_ALLREDUCE_SHORT)
    expected = model._node_reduce(n, per_node, ws) + leaders + model._node_bcast(n, per_node, ws)
    assert model.flat(n, ranks, per_node, NET) == pytest.approx(expected)
    # The leaders' blocking all-reduce of 16 KiB: reduce-scatter + all-gather, two latencies per doubling.
    free = sm.Network(1e-6, math.inf)
    assert model.net_allreduce(n, 16, 1, 0, free, sm.MPICH_ALLREDUCE_SHORT) == pytest.approx(
        8e-6 + sum(model.reduce(n / 2**k, 0) for k in range(1, 5)))
    # An owner's short slice in Iallreduce: recursive doubling, one latency per doubling.
    assert model.net_allreduce(1024, 16, 1, 0, free, sm.MPICH_IALLREDUCE_SHORT) == pytest.approx(
        4 * (1e-6 + model.reduce(1024, 0)))


def test_scratch_buffer_faults_can_be_left_out_of_the_projection():
    model = _truth()
    n = 64 << 20
    with_faults = model.flat(n, 64, 8, NET)
    model.scratch_faults = False
    assert model.faults(n, 64) == 0.0
    assert with_faults - model.flat(n, 64, 8, NET) == pytest.approx(model.machine.fault * n / 2)


def test_predict_prints_fit_checks_and_projection(tmp_path, capsys):
    path = tmp_path / "data.json"
    path.write_text(json.dumps(_data(_truth())))
    assert sm.main(["--predict", "--data", str(path), "--project-sizes", "1M", "--project-ranks", "2", "1024"]) == 0
    out = capsys.readouterr().out
    assert "| +cache |" in out
    assert "| 4 ranks, 2 pretend nodes | window | 64 MiB |" in out
    assert "### 1 MiB" in out and "| 1024 |" in out
    assert "The same MPI call" not in out


def test_predict_names_the_same_mpi_call_measured_too_far_apart(tmp_path, capsys):
    data = _data(_truth())
    assert sm.same_call_disagreements(data["runs"]) == []
    pretend = data["runs"]["4 ranks, 2 pretend nodes"]
    at = pretend["sizes"].index(1 << 20)
    pretend["sweeps_s"]["mpi"][at] = [t * 1.49 for t in pretend["sweeps_s"]["mpi"][at]]  # within: no prediction lost
    pretend["sweeps_s"]["mpi"][at + 1] = [t * 1.6 for t in pretend["sweeps_s"]["mpi"][at + 1]]
    path = tmp_path / "data.json"
    path.write_text(json.dumps(data))
    assert sm.main(["--predict", "--data", str(path), "--project-sizes", "1M", "--project-ranks", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("The same MPI call"))
    assert line.endswith("measure again): 2 MiB: 1.60x slower in '4 ranks, 2 pretend nodes' than in '4 ranks, 1 node'")


def test_the_same_call_check_matches_sizes_judges_from_the_first_judged_size_and_skips_unmeasured_ones():
    runs = {key: dict(run) for key, run in _data(_truth())["runs"].items()}
    one, pretend = runs["4 ranks, 1 node"], runs["4 ranks, 2 pretend nodes"]
    mpi = list(one["time_s"]["mpi"])
    at = {n: i for i, n in enumerate(one["sizes"])}
    slow = [2 * t if n in (32 << 10, 64 << 10, 4 << 20) else t for n, t in zip(one["sizes"], mpi)]
    slow[at[8 << 20]] = None  # not measured in one layout: nothing to compare
    mpi[at[8 << 20]] = 0.1 * mpi[at[8 << 20]]
    one["time_s"] = dict(one["time_s"], mpi=mpi)
    pretend["time_s"] = dict(pretend["time_s"], mpi=slow)
    assert sm.same_call_disagreements(runs) == [
        "64 KiB: 2.00x slower in '4 ranks, 2 pretend nodes' than in '4 ranks, 1 node'",
        "4 MiB: 2.00x slower in '4 ranks, 2 pretend nodes' than in '4 ranks, 1 node'"]
    keep = [i for i, n in enumerate(pretend["sizes"]) if n != 1 << 20]  # a shorter list: compared where it overlaps
    pretend["sizes"] = [pretend["sizes"][i] for i in keep]
    pretend["time_s"] = dict(pretend["time_s"], mpi=[slow[i] for i in keep])
    assert len(sm.same_call_disagreements(runs)) == 2


def test_predict_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="--measure"):
        sm.load_data(str(tmp_path / "absent.json"))
    bad = _data(_truth())
    del bad["runs"]["4 ranks, 1 node"]["sweeps_s"]["window"]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"'4 ranks, 1 node' lacks sweeps_s.window"):
        sm.load_data(str(tmp_path / "bad.json"))
    no_fit = _data(_truth())
    del no_fit["runs"][sm.FIT_LAYOUT]
    (tmp_path / "nofit.json").write_text(json.dumps(no_fit))
    with pytest.raises(SystemExit, match="no '2 ranks, 1 node' run"):
        sm.main(["--predict", "--data", str(tmp_path / "nofit.json")])
    no_core = _data(_truth())
    del no_core["runs"][sm.SAME_CORE_LAYOUT]
    (tmp_path / "nocore.json").write_text(json.dumps(no_core))
    with pytest.raises(SystemExit, match="'4 ranks, 1 node', '4 ranks, 2 pretend nodes' put ranks on a shared core.*"
                                         "bind-to user:C,C"):
        sm.main(["--predict", "--data", str(tmp_path / "nocore.json")])


def test_predictions_are_judged_on_the_statistic_of_the_sweeps_asked_for(tmp_path, capsys):
    """A held-out size whose sweeps met a slow spell: the least sweep is on the model, the median is not."""
    data = _data(_truth())
    run = data["runs"]["4 ranks, 1 node"]
    for path in sm.PATHS:
        for k, sweeps in enumerate(run["sweeps_s"][path]):
            run["sweeps_s"][path][k] = [sweeps[0], 3 * sweeps[0], 3 * sweeps[0]]  # two of three sweeps slow
    path = tmp_path / "data.json"
    path.write_text(json.dumps(data))
    assert sm.load_data(str(path), "min")["runs"]["4 ranks, 1 node"]["time_s"]["mpi"] == \
        [s[0] for s in run["sweeps_s"]["mpi"]]
    held = [c for c in sm.held_out(sm.checks(sm.load_data(str(path)), [_truth()])) if c.layout == "4 ranks, 1 node"]
    assert held and max(abs(c.errors()[0]) for c in held) < 1e-6
    (ab_min, total), (cache_min, _) = sm.within_counts(sm.load_data(str(path)), "min")
    (ab_median, _), (cache_median, _) = sm.within_counts(sm.load_data(str(path)), "median")
    assert cache_min == total and cache_median == total - 2 * 11  # the layout's 11 sizes of both paths
    assert sm.main(["--predict", "--data", str(path), "--project-sizes", "1M", "--project-ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert f"min: alpha-beta {ab_min}/{total}, +cache {total}/{total}; median: alpha-beta {ab_median}/{total}" in out


def test_appended_sweeps_join_the_earlier_ones_and_keep_each_rounds_facts():
    first, second = _run(_truth(), 4, 1, 2, sm.SIZES), _run(_truth(), 4, 1, 2, sm.SIZES)
    for run, when in ((first, "10:00"), (second, "10:05")):
        run.update(when_utc=when, seconds=20.0, load_average=[[1.0], [1.0]], commit="abc",
                   iterations=[[10] for _ in sm.SIZES])
    second["sweeps_s"]["mpi"] = [[2 * s[0]] for s in second["sweeps_s"]["mpi"]]
    merged = sm._appended(first, second)
    assert merged["sweeps_s"]["mpi"][3] == [first["sweeps_s"]["mpi"][3][0], 2 * first["sweeps_s"]["mpi"][3][0]]
    assert merged["median_s"]["mpi"][3] == pytest.approx(1.5 * first["sweeps_s"]["mpi"][3][0])
    assert merged["iterations"][0] == [10, 10] and merged["seconds"] == 40.0
    assert [r["when_utc"] for r in merged["rounds"]] == ["10:00", "10:05"]
    other = _run(_truth(), 2, 1, 2, sm.SIZES)
    with pytest.raises(ValueError, match="ranks=4.*measure without --append"):
        sm._appended(first, other)
    third = dict(second, when_utc="10:10")
    again = sm._appended(merged, third)  # onto an entry that has rounds already
    assert [r["when_utc"] for r in again["rounds"]] == ["10:00", "10:05", "10:10"] and again["when_utc"] == "10:00"
    assert len(again["sweeps_s"]["mpi"][0]) == 3
    big = sm.SIZES.index(2 * sm.FIT_MAX)  # the fault probe stops at 1 MiB: nothing measured stays None
    assert again["sweeps_s"]["fault"][big] == [] and again["median_s"]["fault"][big] is None


def test_append_is_checked_before_measuring_and_the_file_keeps_only_measurements(tmp_path):
    path = str(tmp_path / "data.json")
    facts = {"ranks": 4, "nodes": 1, "local": 4, "machine_ranks": 4, "cores": 2, "sizes": sm.SIZES,
             "window": {"name": "shm"}, "mpi_library": "MPICH 5", "commit": "abc", "fault_probe": sm.FAULT_PROBE,
             "measured": ["mpi", "window", sm.WAITED]}
    assert sm._append_state(path, "4 ranks, 1 node", facts) == (None, 0)  # no file: a new entry
    run = dict(_run(_truth(), 4, 1, 2, sm.SIZES), **facts)
    run.update(median_s=run["time_s"], when_utc="10:00", seconds=1.0, load_average=[[1.0], [1.0]],
               iterations=[[5] for _ in sm.SIZES])
    sm._merge(path, "4 ranks, 1 node", run)
    sm._merge(path, "2 ranks, 1 node", dict(run, ranks=2))
    with open(path) as f:
        assert all("time_s" not in entry for entry in json.load(f)["runs"].values())
    assert sm._append_state(path, "4 ranks, 1 node", facts) == (None, 1)
    problem, _ = sm._append_state(path, "4 ranks, 1 node", dict(facts, commit="def+dirty"))
    assert problem.startswith("the data file's run has commit='abc', this one 'def+dirty'")
    # an entry measured before mpi_waited (no "measured") takes no sweeps that have it
    older = {k: v for k, v in run.items() if k != "measured"}
    sm._merge(path, "4 ranks, 1 node", older)
    problem, _ = sm._append_state(path, "4 ranks, 1 node", facts)
    assert problem.startswith("the data file's run has measured=None, this one ['mpi', 'window', 'mpi_waited']")
    # nor one that timed the wait among the paths (the seventeenth session's)
    sm._merge(path, "4 ranks, 1 node", dict(run, measured=sm.ROTATED_WAIT))
    problem, _ = sm._append_state(path, "4 ranks, 1 node", dict(facts, measured=sm.MEASURED))
    assert problem.startswith(f"the data file's run has measured={sm.ROTATED_WAIT!r}, this one {sm.MEASURED!r}")


def test_the_fit_refuses_an_oversubscribed_or_wrong_layout():
    runs = _data(_truth())["runs"]
    with pytest.raises(ValueError, match="needs the '2 ranks, 1 node' run"):
        sm.fit(runs["4 ranks, 1 node"], constant=False)
    with pytest.raises(ValueError, match="needs the '2 ranks, 1 node' run, 2 ranks with a core per rank"):
        sm.fit(runs[sm.SAME_CORE_LAYOUT], constant=False)
    with pytest.raises(ValueError, match="needs the '2 ranks, 1 node, one core' run, 2 ranks with both ranks on one"):
        sm.fit(runs[sm.FIT_LAYOUT], constant=False, core_run=runs["4 ranks, 1 node"])
    unbound = dict(runs[sm.FIT_LAYOUT], cores=16)  # ranks free to run on all of a machine's cores: a core each
    sm.fit(unbound, constant=False)  # accepted: no ValueError


def test_ranks_sharing_cores_unevenly_are_named_not_modelled():
    with pytest.raises(ValueError, match="4 ranks on 3 cores"):
        _truth().measured_layout("mpi", 1 << 20, 4, 1, 3)


def test_predict_names_runs_whose_fault_probe_is_the_old_one(tmp_path, capsys):
    data = _data(_truth())
    del data["runs"]["4 ranks, 1 node"]["fault_probe"]
    (tmp_path / "data.json").write_text(json.dumps(data))
    assert sm.main(["--predict", "--data", str(tmp_path / "data.json"), "--project-sizes", "1M",
                    "--project-ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("its fault probe is not 'private pages, after the sweeps'") == 1


def test_the_library_s_wait_is_fitted_per_call_and_added_once_per_cross_node_exchange(tmp_path, capsys):
    truth = _truth()
    # Across nodes the owners complete their Iallreduce with the waiter, a core each; on one node there is none.
    n = float(1 << 20)
    without = sm.Model(truth.machine, truth.a_window, truth.b_window, truth.a_mpi, truth.b_mpi, truth.a_eager)
    assert truth.hierarchical(n, 64, 8, NET) == pytest.approx(without.hierarchical(n, 64, 8, NET) + truth.wait)
    assert truth.hierarchical(n, 8, 8, NET) == pytest.approx(without.hierarchical(n, 8, 8, NET))
    # The fit takes the median over the fitted sizes of what the waited call costs more, a run without it nothing.
    data = _data(truth)
    run = data["runs"][sm.FIT_LAYOUT]
    extra = [1.0 if s > sm.FIT_MAX else 5e-6 if i % 2 else 3e-6 for i, s in enumerate(run["sizes"])]
    run["sweeps_s"][sm.WAIT_REFERENCE] = [[t] for t in run["time_s"]["mpi"]]  # measured at every size, here
    run["sweeps_s"][sm.WAITED] = [[t + e] for t, e in zip(run["time_s"]["mpi"], extra)]
    assert sum(e == 3e-6 for e in extra) == 5 and sum(e == 5e-6 for e in extra) == 4  # 4 KiB..1 MiB
    assert statistics.median(extra) == 5e-6  # all sizes: what a fit that kept the held-out ones would give
    assert sm.fit(run, constant=False).wait == pytest.approx(3e-6)
    # The wait is what the waited call costs more than the Allreduce timed beside it, not the sweeps' mpi.
    run["sweeps_s"][sm.WAIT_REFERENCE] = [[t - 1e-6] for t in run["time_s"]["mpi"]]
    assert sm.fit(run, constant=False).wait == pytest.approx(4e-6)
    # Each size's extra is the median of the rounds' differences, each round's two calls timed together; the least
    # of each name (7 and 10 us, from different rounds) would give 3 us.
    run["sweeps_s"][sm.WAITED] = [[10e-6, 30e-6, 12e-6] for _ in run["sizes"]]
    run["sweeps_s"][sm.WAIT_REFERENCE] = [[9e-6, 28e-6, 7e-6] for _ in run["sizes"]]
    assert sm.fit(run, constant=False).wait == pytest.approx(2e-6)
    for entry in data["runs"].values():
        del entry["sweeps_s"][sm.WAITED], entry["sweeps_s"][sm.WAIT_REFERENCE], entry["measured"]
    (tmp_path / "data.json").write_text(json.dumps(data))
    assert sm.main(["--predict", "--data", str(tmp_path / "data.json"), "--project-sizes", "1M",
                    "--project-ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("a file from before the seventeenth session") == len(data["runs"])
    models = sm.fit_all(sm.load_data(str(tmp_path / "data.json"))["runs"])
    assert all(m.wait == 0.0 and m.wait_core == 0.0 for m in models)


def test_a_file_that_timed_the_wait_among_the_paths_is_named_and_its_wait_taken_against_mpi(tmp_path, capsys):
    data = _data(_truth())
    for entry in data["runs"].values():  # as the seventeenth session measured: mpi_waited in the sweeps, no reference
        entry["measured"] = sm.ROTATED_WAIT
        entry["sweeps_s"][sm.WAITED] = [[t + 2e-6] for t in entry["time_s"]["mpi"]]
        del entry["sweeps_s"][sm.WAIT_REFERENCE]
    (tmp_path / "data.json").write_text(json.dumps(data))
    assert sm.main(["--predict", "--data", str(tmp_path / "data.json"), "--project-sizes", "1M",
                    "--project-ranks", "2"]) == 0
    assert capsys.readouterr().out.count("it timed mpi_waited among the judged paths") == len(data["runs"])
    models = sm.fit_all(sm.load_data(str(tmp_path / "data.json"))["runs"])
    assert all(m.wait == pytest.approx(2e-6) and m.wait_core == pytest.approx(2e-6) for m in models)


def test_layout_keys_name_a_shared_core():
    assert sm.layout_key(2, 1, False) == sm.FIT_LAYOUT
    assert sm.layout_key(2, 1, False, one_core=True) == sm.SAME_CORE_LAYOUT
    assert sm.layout_key(4, 2, True) == "4 ranks, 2 pretend nodes"


@pytest.mark.timeout(150)
def test_measure_on_one_core_writes_the_same_core_layout_and_its_fault_probe(tmp_path):
    """A real --measure with both ranks bound to one core: the entry the fit reads, its placement recorded."""
    mpiexec = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if mpiexec is None:
        pytest.skip("no mpiexec next to the Python interpreter (install mpistrat[mpich])")
    core = min(os.sched_getaffinity(0))
    data = tmp_path / "sm.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_"))}
    cmd = ["timeout", "-k", "10", "100", mpiexec, "-bind-to", f"user:{core},{core}", "-n", "2", sys.executable, _PATH,
           "--measure", "--data", str(data), "--max-size", "2M", "--repeats", "1", "--budget", "0.01"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=130, env=env, stdin=subprocess.DEVNULL,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    run = sm.load_data(str(data))["runs"][sm.SAME_CORE_LAYOUT]
    assert run["cores"] == 1 and run["machine_ranks"] == 2 and run["affinity"] == [[core], [core]]
    fitted = [n <= sm.FIT_MAX for n in run["sizes"]]
    assert run["sizes"][-1] == 2 * sm.FIT_MAX and not fitted[-1]
    assert [t is not None and t > 0 for t in run["time_s"]["fault"]] == fitted  # every size up to 1 MiB, no further
    assert run["fault_probe"] == sm.FAULT_PROBE
    assert run["measured"] == ["mpi", "window", "shm_pass", "private_pass", "fault", sm.WAIT_REFERENCE, sm.WAITED]
    for name in (sm.WAIT_REFERENCE, sm.WAITED):  # after the sweeps, once, beside each other, up to 1 MiB
        assert [t is not None and t > 0 for t in run["time_s"][name]] == fitted
        assert [len(v) for v in run["sweeps_s"][name]] == [int(f) for f in fitted]
    assert done.stdout.count(f": {sm.WAIT_REFERENCE} ") == sum(fitted)
    assert all(t > 0 for t in run["time_s"]["mpi"]) and len(run["time_s"]["mpi"]) == len(fitted)


def _vma_facts(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    facts: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:  # a mapping's first line: lo-hi perms ...
                lo, hi = (int(x, 16) for x in head.split("-"))
                if inside:
                    break
                inside = lo <= address < hi
            elif inside:
                key, _, value = line.partition(":")
                facts[key] = value.strip()
    return facts


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="Linux's /proc/self/smaps tells a mapping's pages")
def test_the_measured_private_memory_lies_on_4_kib_pages_every_page_written():
    region = sm.private_region(8 << 20)  # above NumPy's 4 MiB huge-page advice
    assert region.nbytes == 8 << 20 and region.dtype.name == "float32" and not region.any()
    facts = _vma_facts(region.ctypes.data)
    assert "nh" in facts["VmFlags"].split()  # MADV_NOHUGEPAGE
    assert facts["AnonHugePages"] == "0 kB"
    assert int(facts["Rss"].split()[0]) >= 8 << 10  # every page written: no zero page read


@pytest.mark.parametrize("argv, message", [
    (["--predict", "--project-ranks", "3"], "powers of two"),
    (["--predict", "--max-size", "64K"], "at least 1 MiB"),
    (["--predict", "--net-gbps", "0"], "--net-gbps > 0"),
    (["--all", "--rounds", "0"], "--rounds must be >= 1"),
    (["--predict", "--statistic", "mean"], "invalid choice: 'mean'"),
    (["--predict", "--project-sizes", "lots"], "not a size"),
    (["--measure", "--predict"], "not allowed with"),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit):
        sm.main(argv)
    assert message in capsys.readouterr().err


def test_measure_names_a_data_file_it_could_not_merge_into(tmp_path):
    assert sm._data_problem(str(tmp_path / "new.json")) is None
    assert "cannot write" in sm._data_problem(str(tmp_path / "absent" / "data.json"))
    (tmp_path / "other.json").write_text(json.dumps({"something": "else"}))
    assert "not a scale_model.py data file" in sm._data_problem(str(tmp_path / "other.json"))


def test_the_mpi_fit_needs_two_kernel_copied_sizes_and_takes_the_short_latency_where_there_are_short_ones(monkeypatch):
    run = _data(_truth())["runs"][sm.FIT_LAYOUT]
    monkeypatch.setattr(sm, "MPICH_CMA_MIN", sm.FIT_MAX // 2)  # only 1 MiB's steps are kernel copies
    with pytest.raises(ValueError, match="two sizes or more from 1 MiB up to 1 MiB"):
        sm.fit(run, constant=False)
    monkeypatch.setattr(sm, "MPICH_CMA_MIN", 1)  # every step a kernel copy: no short latency to fit
    assert sm.fit(run, constant=False).a_eager is None


def test_the_short_steps_latency_is_never_negative():
    run = _data(_truth())["runs"][sm.FIT_LAYOUT]
    short = [n for n in run["sizes"] if n / 2 < sm.MPICH_CMA_MIN]
    assert short  # 4 and 8 KiB
    for i in range(len(short)):  # faster than the per-byte cost alone allows
        run["time_s"]["mpi"][i] = 1e-9
    assert sm.fit(run, constant=False).a_eager == 0.0
