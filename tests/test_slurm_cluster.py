"""Cluster resolvers and ``info`` inside real Slurm steps (local single-node cluster).

The ``slurm_cluster`` fixture (tests/slurm.py) installs and starts Slurm when
needed; these tests skip only when Slurm cannot be installed.
"""

import json
import sys
import textwrap

import pytest
from slurm import slurm_cluster  # noqa: F401  (the fixture)

from mpistrat.cluster.hostlist import expand_hostlist


def slurm_test(func):
    """Mark a test as needing the cluster; its first use may apt-get install Slurm."""
    return pytest.mark.slurm(pytest.mark.timeout(900)(func))


PROBE = textwrap.dedent("""\
    import json, os, sys
    from mpistrat.cluster.resolvers import SlurmClusterResolver
    gpus_per_node = int(sys.argv[1]) if len(sys.argv) > 1 else None
    s = SlurmClusterResolver(gpus_per_node=gpus_per_node)   # before MPI and CUDA
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    from mpi4py import MPI
    from mpistrat.cluster.resolvers import MPIClusterResolver, default_cluster_resolver
    m = MPIClusterResolver()
    d = default_cluster_resolver()
    sys.stdout.write(json.dumps({
        "procid": int(os.environ["SLURM_PROCID"]), "localid": int(os.environ["SLURM_LOCALID"]),
        "rank": MPI.COMM_WORLD.Get_rank(), "size": MPI.COMM_WORLD.Get_size(),
        "slurm": {"task": [s.task_type, s.task_id], "spec": s.cluster_spec().as_dict(),
                  "gpus": s.num_accelerators(), "devices": s.local_devices(), "cvd": cvd,
                  "alloc": s.gpu_allocation(), "master": s.master()},
        "mpi": {"task": [m.task_type, m.task_id], "spec": m.cluster_spec().as_dict(),
                "local": [m.local_rank, m.local_size], "devices": m.local_devices()},
        "default": type(d).__name__,
    }) + "\\n")  # one write per line: tasks share the output file
    sys.stdout.flush()
""")


@pytest.fixture
def probe(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return str(path)


def _records(stdout):
    recs = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return sorted(recs, key=lambda r: r["rank"])


@pytest.fixture
def srun_mpi(slurm_cluster):  # noqa: F811
    """The ``srun --mpi`` plugin that wires this MPI; skips where none does (``test_srun_two_tasks`` then
    checks the error every task gives instead)."""
    plugin = slurm_cluster.mpi_plugin()
    if plugin is None:
        pytest.skip("srun cannot wire this MPI here (Open MPI 5 needs PMIx, whose library this Slurm lacks); "
                    "test_srun_two_tasks checks the error the tasks give")
    return plugin


@slurm_test
def test_srun_two_tasks(slurm_cluster, probe):  # noqa: F811
    plugin = slurm_cluster.mpi_plugin()
    out = slurm_cluster.srun([sys.executable, probe], 2, mpi=plugin or "pmi2")
    if plugin is None:  # every task is alone in its MPI world: each says so, none trains alone
        assert out.returncode != 0 and out.stderr.count("Slurm started 2 tasks in this step") == 2, out.stderr
        assert "srun --mpi=pmix" in out.stderr and "MPIClusterResolver()" in out.stderr
        return
    assert out.returncode == 0, out.stderr + slurm_cluster.logs()
    recs = _records(out.stdout)
    assert [r["rank"] for r in recs] == [0, 1] and all(r["size"] == 2 for r in recs)
    host = slurm_cluster.hostname
    spec = {"worker": [f"{host}:8888", f"{host}:8889"]}
    for r in recs:
        assert r["procid"] == r["rank"] and r["localid"] == r["rank"]
        assert r["slurm"]["task"] == ["worker", r["rank"]] == r["mpi"]["task"]
        assert r["slurm"]["spec"] == spec == r["mpi"]["spec"]
        assert r["slurm"]["master"] == f"grpc://{host}:{8888 + r['rank']}"
        assert r["mpi"]["local"] == [r["rank"], 2]
        assert r["default"] == "SlurmClusterResolver"
        assert r["slurm"]["devices"] == r["mpi"]["devices"] == ["/cpu:0"]  # CPU node
        assert r["slurm"]["gpus"] == {"GPU": 0}


@slurm_test
def test_srun_gpu_binding_uses_real_local_ids(slurm_cluster, probe, srun_mpi):  # noqa: F811
    out = slurm_cluster.srun([sys.executable, probe, "4"], 4, mpi=srun_mpi)
    assert out.returncode == 0, out.stderr
    recs = _records(out.stdout)
    assert [r["slurm"]["cvd"] for r in recs] == ["0", "1", "2", "3"]
    assert all(r["slurm"]["devices"] == ["/gpu:0"] and r["slurm"]["gpus"] == {"GPU": 1} for r in recs)
    out = slurm_cluster.srun([sys.executable, probe, "8"], 2, mpi=srun_mpi)
    assert out.returncode == 0, out.stderr
    recs = _records(out.stdout)
    assert [r["slurm"]["cvd"] for r in recs] == ["0,1,2,3", "4,5,6,7"]
    assert recs[0]["slurm"]["alloc"] == ["0,1,2,3", "4,5,6,7"]


@slurm_test
def test_srun_info(slurm_cluster, srun_mpi):  # noqa: F811
    out = slurm_cluster.srun([sys.executable, "-m", "mpistrat", "info", "--json"], 2, mpi=srun_mpi)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["job"]["world_size"] == 2
    assert [r["resolver"] for r in data["ranks"]] == ["SlurmClusterResolver"] * 2
    assert [r["local_rank"] for r in data["ranks"]] == [0, 1]


@slurm_test
def test_sbatch_wait(slurm_cluster, probe):  # noqa: F811
    # srun's tasks, where srun wires this MPI, then mpiexec's ranks (Open MPI's mpirun inside the
    # allocation: the way to run it where Slurm has no PMIx).
    plugin = slurm_cluster.mpi_plugin()
    srun = f"srun --mpi={plugin} {sys.executable} {probe}" if plugin else ""
    # The ranks mpiexec starts are no Slurm step's tasks (Open MPI's even lack the SLURM_STEP_ variables).
    # One write per line: the ranks share the output file.
    ranks = ("import json, sys; from mpi4py import MPI; from mpistrat.cluster.resolvers import default_cluster_resolver; "
             "sys.stdout.write(json.dumps({'rank': MPI.COMM_WORLD.rank, 'size': MPI.COMM_WORLD.size, "
             "'default': type(default_cluster_resolver()).__name__}) + chr(10)); sys.stdout.flush()")
    script = textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --ntasks=2
        set -e
        echo "tasks=$SLURM_NTASKS"
        {srun}
        mpiexec -n 2 {sys.executable} -c "{ranks}"
        echo done
    """)
    job = slurm_cluster.sbatch(script)
    assert job.returncode == 0, job.output + job.stderr
    assert job.job_id.isdigit()
    lines = job.output.splitlines()
    assert lines[0] == "tasks=2" and lines[-1] == "done"
    recs = [json.loads(line) for line in lines if line.startswith("{")]
    assert len(recs) == (4 if plugin else 2)
    assert all(r["size"] == 2 for r in recs)
    by_default = sorted((r["default"], r["rank"]) for r in recs)
    # srun's tasks are a step of their own (Slurm); mpiexec's ranks are not (MPI).
    expected = [("MPIClusterResolver", 0), ("MPIClusterResolver", 1)]
    assert by_default == expected + ([("SlurmClusterResolver", 0), ("SlurmClusterResolver", 1)] if plugin else [])


@slurm_test
def test_sbatch_wait_reports_failure(slurm_cluster):  # noqa: F811
    job = slurm_cluster.sbatch("#!/bin/bash\necho about to fail\nexit 3\n")
    assert job.returncode != 0
    assert "about to fail" in job.output


@slurm_test
def test_expand_hostlist_agrees_with_scontrol(slurm_cluster):  # noqa: F811
    for text in ["n[1-2],m5,o[3-4,6,7-9]", "n[0001-0003],m5,o[009-011]", "n[8-11]", "r[1-2]n[01-02]",
                 "n[001-3]", "n[1-010]", "n[3,1-2]", "b,a,b", "login,gpu[1-2]"]:
        out = slurm_cluster.run(["scontrol", "show", "hostnames", text], timeout=30)
        assert out.returncode == 0 and out.stdout.split(), out.stderr
        assert expand_hostlist(text) == out.stdout.split(), text


@slurm_test
def test_cluster_start_is_idempotent(slurm_cluster):  # noqa: F811
    conf = slurm_cluster.conf.read_text()
    assert slurm_cluster.start() is slurm_cluster
    assert slurm_cluster.conf.read_text() == conf
    assert slurm_cluster.node_state().rstrip("*") in ("idle", "mix", "alloc")


# ----------------------------------------------------------------------------- the fixture's own logic
# (not marked slurm: these need no cluster)

def test_cannot_install_without_root(monkeypatch):
    import slurm

    monkeypatch.setattr(slurm, "_have_binaries", lambda: False)
    monkeypatch.setattr(slurm.os, "geteuid", lambda: 1000)
    with pytest.raises(slurm.SlurmUnavailable, match="needs root"):
        slurm.ensure_slurm(log=lambda msg: None)


def test_cannot_install_without_apt(monkeypatch):
    import slurm

    monkeypatch.setattr(slurm, "_have_binaries", lambda: False)
    monkeypatch.setattr(slurm.os, "geteuid", lambda: 0)
    monkeypatch.setattr(slurm.shutil, "which", lambda name: None)
    with pytest.raises(slurm.SlurmUnavailable, match="no apt-get"):
        slurm.ensure_slurm(log=lambda msg: None)


def test_cluster_config_is_private(tmp_path):
    import slurm

    cluster = slurm.SlurmCluster(tmp_path / "c", log=lambda msg: None)
    cluster._write_conf()
    conf = cluster.conf.read_text()
    assert f"StateSaveLocation={tmp_path / 'c'}/state" in conf
    assert f"NodeName={cluster.hostname} " in conf and "CPUs=8" in conf
    assert cluster.env["SLURM_CONF"] == str(cluster.conf)
    assert not any(k.startswith(("SLURM_JOB", "SLURM_PROCID", "SLURM_STEP")) for k in cluster.env)
    cluster._write_conf()  # idempotent: same ports
    assert cluster.conf.read_text() == conf
    cluster.stop()
    assert not (tmp_path / "c").exists()
