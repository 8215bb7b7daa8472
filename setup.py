"""The C extensions, which pyproject.toml cannot yet declare outside an experimental table."""

from setuptools import Extension, setup

# Both are optional: where they do not build (no C compiler), the install goes on and the calls they
# speed up take their Python paths.
setup(ext_modules=[
    # The compiled lane of repeated small all-reduces (mpistrat/comm/agreement/lane.py).
    Extension("mpistrat.comm.agreement._lane", ["mpistrat/comm/agreement/_lane.c"], optional=True),
    # A call's list of arrays matched against its plan's signature and packed (comm/signature.py, fusion.py).
    Extension("mpistrat.comm._arraylist", ["mpistrat/comm/_arraylist.c"], optional=True),
    # The optimizers' update rules in one pass (mpistrat/train/kernels.py). Their bits are NumPy's only
    # with nothing contracted into fused multiply-adds (which -march flags with FMA would otherwise allow);
    # without errno, sqrt vectorizes.
    Extension("mpistrat.train._update", ["mpistrat/train/_update.c"], optional=True,
              extra_compile_args=["-ffp-contract=off", "-fno-math-errno"]),
])
