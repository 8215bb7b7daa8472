#!/usr/bin/env python3
"""The README's main job: ``mpiexec -n 4 python examples/train.py`` (see mpistrat/examples/train.py)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # a checkout without install
from mpistrat.examples.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
