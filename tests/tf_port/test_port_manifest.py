"""The port covers every test method of the pinned TF files (scripts/check_tf_port.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_tf_method_is_ported_or_listed():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "check_tf_port.py")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
