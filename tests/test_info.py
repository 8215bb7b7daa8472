"""``python -m mpistrat info``: one process, mpiexec -n 4, JSON, and the command line."""

import json
import os
import shutil
import subprocess
import sys

import pytest
from mpi4py import MPI

from mpistrat import config
from mpistrat.tools.cli import COMMANDS, main
from mpistrat.devices import num_gpus
from mpistrat.tools.info import collect, format_table, mpi_cuda_support


def _env(**extra):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "HYDRA_", "HYDI_", "OMPI_", "SLURM_")) or k.startswith("OMPI_ALLOW_RUN_AS_ROOT")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.update(extra)
    return env


def _run(args, timeout=120, **extra):
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=_env(**extra),
                          stdin=subprocess.DEVNULL)


def _mpiexec():
    path = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    if path is None:
        pytest.skip("no mpiexec next to the Python interpreter (install mpistrat[mpich])")
    return path


def _rows(stdout):
    """The rank table's rows (it ends at the first blank line)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("rank "))
    rows = []
    for line in lines[start + 1:]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def test_info_single_process():
    out = _run([sys.executable, "-m", "mpistrat", "info"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("MPI library:  ")
    assert MPI.Get_library_version().split()[0] in out.stdout  # e.g. "MPICH"
    assert "world size:   1" in out.stdout
    rows = _rows(out.stdout)
    assert len(rows) == 1
    rank, host, node, local, threads = rows[0][:5]
    assert (rank, node, local) == ("0", "0/1", "0/1")
    assert host == MPI.Get_processor_name()
    assert threads in ("single", "funneled", "serialized", "multiple")
    expected = ",".join([f"/gpu:{i}" for i in range(num_gpus())] or ["/cpu:0"])
    assert rows[0][-1] == expected


def test_info_names_an_mpi_library_that_does_not_load_and_the_install_hint(tmp_path):
    missing = str(tmp_path / "libmpi.so.12")
    out = _run([sys.executable, "-m", "mpistrat", "info"], MPI4PY_LIBMPI=missing)
    assert out.returncode == 1 and out.stdout == "", out.stdout + out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "cannot load the MPI library" in out.stderr and f"{missing}: cannot open shared object file" in out.stderr
    assert 'pip install "mpistrat[mpich]"' in out.stderr and f"MPI4PY_LIBMPI={missing}" in out.stderr


def test_info_mpiexec_four_rows():
    out = _run([_mpiexec(), "-n", "4", sys.executable, "-m", "mpistrat", "info"], timeout=120)
    assert out.returncode == 0, out.stderr
    assert "world size:   4" in out.stdout
    rows = _rows(out.stdout)
    assert [r[0] for r in rows] == ["0", "1", "2", "3"]
    assert [r[3] for r in rows] == ["0/4", "1/4", "2/4", "3/4"]
    assert out.stdout.count("MPI library:") == 1  # only rank 0 prints
    # What a communicator over the four ranks chose: the window first, plain MPI last, the check in shm.
    assert "transport shm (min_bytes=" in out.stdout and "transport mpi" in out.stdout
    assert "agreement check: shm" in out.stdout


def test_info_prints_every_setting_and_where_it_came_from():
    out = _run([sys.executable, "-m", "mpistrat", "info"], MPISTRAT_SHM_MAX_BYTES="8M", MPISTRAT_CHECK_NUMERICS="yes")
    assert out.returncode == 0, out.stderr
    settings = {line.split()[0]: line.split()[1:] for line in out.stdout.splitlines()
                if line.strip().startswith("MPISTRAT_")}
    assert settings["MPISTRAT_SHM_MAX_BYTES"] == ["8388608", "environment"]
    assert settings["MPISTRAT_CHECK_NUMERICS"] == ["True", "environment"]
    assert settings["MPISTRAT_TIMEOUT_SECONDS"] == ["600.0", "default"]
    assert settings["MPISTRAT_SHM_BLOCK_BYTES"][1] in ("hardware", "default")
    assert len(settings) == len(config.VARIABLES)  # every setting, each once
    bad = _run([sys.executable, "-m", "mpistrat", "info"], MPISTRAT_SHM_MAX_BYTES="lots")
    assert bad.returncode == 0, bad.stderr  # info still reports, naming the bad variable
    assert "error: MPISTRAT_SHM_MAX_BYTES must be a byte count" in bad.stdout


def test_info_json_pretend_nodes():
    out = _run([_mpiexec(), "-n", "4", sys.executable, "-m", "mpistrat", "info", "--json"],
               MPISTRAT_PRETEND_NODES="2")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["job"]["world_size"] == 4
    ranks = data["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1, 2, 3]
    assert [(r["node"], r["local_rank"]) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["nodes"] == 2 and r["resolver"] == "MPIClusterResolver" for r in ranks)
    assert all(r["cuda_aware"] in (True, False, None) and r["devices"] for r in ranks)


def test_command_line_usage():
    assert "info" in COMMANDS
    out = _run([sys.executable, "-m", "mpistrat"])
    assert out.returncode == 2 and "info" in out.stdout
    out = _run([sys.executable, "-m", "mpistrat", "nosuchcommand"])
    assert out.returncode == 2 and "invalid choice: 'nosuchcommand'" in out.stderr


def test_main_in_process(capsys):
    assert main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"][0]["size"] == MPI.COMM_WORLD.Get_size()


def test_format_table_columns():
    job, rows = collect(MPI.COMM_SELF)
    text = format_table(job, rows)
    header = next(line for line in text.splitlines() if line.startswith("rank "))
    for column in ("host", "node", "local", "threads", "cuda-aware", "resolver", "cupy", "gpus", "devices"):
        assert column in header
    assert rows[0]["gpus"] == num_gpus()


def test_cuda_support_of_pypi_mpich():
    version = MPI.Get_library_version()
    if "pypi.org/p/mpich" not in version:
        pytest.skip("only the PyPI MPICH build is known here (built without CUDA)")
    assert mpi_cuda_support() is False


def test_cuda_aware_forced_and_bad_value(monkeypatch):
    out = _run([sys.executable, "-m", "mpistrat", "info", "--json"], MPISTRAT_CUDA_AWARE="1")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["ranks"][0]["cuda_aware"] is True
    monkeypatch.setenv("MPISTRAT_CUDA_AWARE", "maybe")
    assert mpi_cuda_support().startswith("error: ValueError: MPISTRAT_CUDA_AWARE must be one of 1/true/yes/on or 0/false")


@pytest.mark.mpi(min_size=2)
def test_collect_gathers_every_rank(comm):
    result = collect(comm)
    if comm.Get_rank() == 0:
        job, rows = result
        assert job["world_size"] == comm.Get_size()
        assert [r["rank"] for r in rows] == list(range(comm.Get_size()))
        job_lines, table, settings, chosen = format_table(job, rows).split("\n\n")
        assert len(job_lines.splitlines()) == 3 and len(table.splitlines()) == 1 + comm.Get_size()
        assert settings.startswith("settings") and len(settings.splitlines()) == 2 + len(job["settings"])
        assert chosen.splitlines()[0] == "a communicator over all ranks chose:"
        assert [t["name"] for t in job["communicator"]["transports"]][-1] == "mpi"
        assert "transport mpi" in chosen
    else:
        assert result is None


def test_info_names_the_crc32c_implementation_and_nccl():
    out = _run([sys.executable, "-m", "mpistrat", "info"])
    assert out.returncode == 0, out.stderr
    assert "CRC-32C google-crc32c (c)" in out.stdout.splitlines()[1]
    header = next(line for line in out.stdout.splitlines() if line.startswith("rank "))
    assert header.split()[7:9] == ["cupy", "nccl"]
    row = out.stdout.splitlines()[out.stdout.splitlines().index(header) + 1].split()
    if num_gpus() == 0:
        assert "-" in row  # no GPU: no NCCL to name
