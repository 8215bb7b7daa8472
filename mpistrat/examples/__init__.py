"""Example programs shipped with mpistrat (``python -m mpistrat.examples.train``)."""

__all__: list[str] = []
