"""Imports mpistrat from ``PYTHONPATH`` even where mpistrat is installed in editable mode.

``compare_trees.py`` runs each checkout with ``PYTHONPATH=<this folder>:<tree>``. An editable install
(``pip install -e .``) adds an import finder to ``sys.meta_path`` that maps ``mpistrat`` to the
installed checkout before ``PYTHONPATH`` is searched, so without this both runs would time the
installed code. Python imports ``sitecustomize`` after the ``.pth`` files, so this drops that finder.
"""

import sys

sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
