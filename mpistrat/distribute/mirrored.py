"""MirroredStrategy: synchronous replicas on several devices of one process."""

from __future__ import annotations

from typing import Sequence

from mpistrat import devices as dev
from mpistrat.distribute.cross_device_ops import CrossDeviceOps
from mpistrat.distribute.strategy import Strategy, StrategyExtended

__all__ = ["MirroredStrategy"]


class MirroredStrategy(Strategy):
    """One replica per device, each in its own thread, kept in sync by all-reduce.

    ``devices`` defaults to every GPU CuPy sees, else one CPU device; logical
    CPU devices (``["/cpu:0", "/cpu:1"]``) give several replicas on NumPy.
    """

    def __init__(self, devices: Sequence[str] | None = None, cross_device_ops: CrossDeviceOps | None = None):
        devices = dev.device_list(dev.default_local_devices() if devices is None else devices, "devices")
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise ValueError(f"`cross_device_ops` must be a CrossDeviceOps, got {type(cross_device_ops).__name__}")
        super().__init__(StrategyExtended(self, devices, cross_device_ops=cross_device_ops))
