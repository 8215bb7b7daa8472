"""OneDeviceStrategy: everything on one device, in one replica."""

from __future__ import annotations

from typing import Any, Callable

from mpistrat import devices as dev
from mpistrat.distribute.input_options import InputOptions, InputReplicationMode
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

    def distribute_datasets_from_function(self, dataset_fn: Callable, options: Any = None) -> Any:
        """As :meth:`Strategy.distribute_datasets_from_function`; PER_REPLICA is not supported (as TF)."""
        if isinstance(options, InputOptions) and \
                options.experimental_replication_mode == InputReplicationMode.PER_REPLICA:
            raise NotImplementedError("InputReplicationMode.PER_REPLICA is only supported in "
                                      "`experimental_distribute_datasets_from_function` of tf.distribute.MirroredStrategy")
        return super().distribute_datasets_from_function(dataset_fn, options)

    experimental_distribute_datasets_from_function = distribute_datasets_from_function

    def __repr__(self) -> str:
        return f"<OneDeviceStrategy device={self._device}>"
