"""MirroredStrategy: synchronous replicas on several devices of one process."""

from __future__ import annotations

from typing import Sequence

from mpistrat import devices as dev
from mpistrat.distribute.cross_device_ops import CrossDeviceOps
from mpistrat.distribute.strategy import Strategy, StrategyExtended

__all__ = ["MirroredStrategy"]


def _default_devices() -> list[str]:
    n = dev.num_gpus()
    return [f"/gpu:{i}" for i in range(n)] if n else ["/cpu:0"]


class MirroredStrategy(Strategy):
    """One replica per device, each in its own thread, kept in sync by all-reduce.

    ``devices`` defaults to every GPU CuPy sees, else one CPU device; logical
    CPU devices (``["/cpu:0", "/cpu:1"]``) give several replicas on NumPy.
    """

    def __init__(self, devices: Sequence[str] | None = None, cross_device_ops: CrossDeviceOps | None = None):
        if devices is None:
            devices = _default_devices()
        if isinstance(devices, str):
            raise ValueError(f"`devices` must be a list of device strings, got the string {devices!r}")
        devices = list(devices)
        if not devices:
            raise ValueError("`devices` must not be empty")
        if cross_device_ops is not None and not isinstance(cross_device_ops, CrossDeviceOps):
            raise ValueError(f"`cross_device_ops` must be a CrossDeviceOps, got {type(cross_device_ops).__name__}")
        super().__init__(StrategyExtended(self, devices, cross_device_ops=cross_device_ops))
