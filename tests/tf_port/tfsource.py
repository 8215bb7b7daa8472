"""The marker that names the TensorFlow 2.21 test methods a ported test covers."""

from __future__ import annotations

import pytest


def tf_source(*ids: str) -> pytest.MarkDecorator:
    """Mark a test as the port of TF test methods, each ``file.py::Class::method``.

    ``scripts/check_tf_port.py`` reads these marks (statically, with ``ast``) and
    checks that every method of the pinned TF files is ported or listed in
    ``tests/tf_port/NOT_PORTED.md``.
    """
    for i in ids:
        if i.count("::") != 2 or not i.split("::")[0].endswith(".py"):
            raise ValueError(f"tf_source id {i!r} is not 'file.py::Class::method'")
    return pytest.mark.tf_source(*ids)
