"""The command-line tools: ``python -m mpistrat COMMAND`` and ``python -m mpistrat.run``."""
