"""``python -m mpistrat.run script.py``: the public path of :mod:`mpistrat.tools.run`."""

from mpistrat.tools.run import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
