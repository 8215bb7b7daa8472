"""The package's metadata: one version, typed, licensed, and nothing that points outside the project."""

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import mpistrat

ROOT = Path(__file__).resolve().parents[1]


def test_version_has_one_source_and_the_cli_prints_it():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "mpistrat.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", mpistrat.__version__)
    out = subprocess.run([sys.executable, "-m", "mpistrat", "--version"], capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == f"mpistrat {mpistrat.__version__}", out


def test_the_package_is_typed_and_licensed():
    assert (ROOT / "mpistrat" / "py.typed").is_file()  # PEP 561: mypy reads the annotations
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["mpistrat"]
    assert project["project"]["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()[:200]


def test_no_project_file_refers_outside_the_project():
    # Everything a reader or a test needs is in the repository (TensorFlow's files in tests/data/).
    tracked = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, timeout=60).stdout.split()
    outside = re.compile(r"\.\./shared|/work/shared|shared/(DESIGN|STYLE|ENVIRONMENT)\.md|shared/(data|seeds)/")
    offenders = []
    for name in tracked:
        path = ROOT / name
        if path.suffix in {".py", ".md", ".sh", ".toml", ".txt", ".cfg", ".yml", ".yaml"} and path.is_file():
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if outside.search(line) and name != "tests/test_packaging.py":
                    offenders.append(f"{name}:{n}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)


def test_the_example_data_ship_with_the_package_and_need_no_scikit_learn():
    code = ("import sys, hashlib; sys.modules['sklearn'] = None\n"  # importing scikit-learn would fail
            "from mpistrat.examples.digits import load_digits\n"
            "x, y = load_digits()\n"
            "print(x.shape, x.min(), x.max(), sorted(set(y.tolist())), hashlib.sha256(x.tobytes()).hexdigest()[:12])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "20def7f70a70" and out.stdout.startswith("(1797, 64) 0.0 16.0 [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"), out.stdout
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "examples/digits.npz" in project["tool"]["setuptools"]["package-data"]["mpistrat"]
    assert "scikit-learn" not in str(project["project"]["optional-dependencies"])
