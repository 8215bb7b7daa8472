"""OneDeviceStrategy: everything on one device, in one replica."""

from __future__ import annotations

from mpistrat import devices as dev
from mpistrat.distribute.strategy import Strategy, StrategyExtended

__all__ = ["OneDeviceStrategy"]


class _OneDeviceExtended(StrategyExtended):
    _distributed_variables = False  # variables are plain variables on the device


class OneDeviceStrategy(Strategy):
    """Run on a single device: variables are placed there and ``run`` executes there.

    A way to test code written for the tf.distribute API before switching to
    a strategy that distributes.
    """

    def __init__(self, device: str):
        self._device = dev.canonicalize(device)
        super().__init__(_OneDeviceExtended(self, [device]))

    def __repr__(self) -> str:
        return f"<OneDeviceStrategy device={self._device}>"
