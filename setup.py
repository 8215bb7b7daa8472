"""The one C extension, which pyproject.toml cannot yet declare outside an experimental table."""

from setuptools import Extension, setup

# The compiled lane of repeated small all-reduces (mpistrat/comm/agreement/lane.py). Optional: where it
# does not build (no C compiler), the install goes on and every such call takes the Python path.
setup(ext_modules=[Extension("mpistrat.comm.agreement._lane", ["mpistrat/comm/agreement/_lane.c"], optional=True)])
