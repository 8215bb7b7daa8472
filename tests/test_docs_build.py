"""The HTML documentation builds without warnings, with every link between its pages resolving."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_docs_build_to_html(tmp_path):
    out = tmp_path / "site"
    run = subprocess.run([sys.executable, "-W", "error", str(ROOT / "scripts" / "build_docs.py"), str(out)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    pages = {p.name for p in out.glob("*.html")}
    assert {"index.html", "design.html", "coming_from.html", "porting.html", "reliability.html"} <= pages
    api = (out / "api" / "mpistrat.html").read_text(encoding="utf-8")
    for name in ("MultiWorkerMirroredStrategy", "MirroredStrategy", "ReplicaContext", "ReduceOp"):
        assert name in api, name
    coming = (out / "coming_from.html").read_text(encoding="utf-8")
    assert 'href="porting.html"' in coming and "<table>" in coming
