"""``python -m mpistrat COMMAND``: the command-line tools of :mod:`mpistrat.tools.cli`."""

import sys

from mpistrat.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
