"""Devices: their names, the array module of each, and where an array lives.

CPU devices hold NumPy arrays; GPU devices hold CuPy arrays, and CuPy is imported only when a GPU
device is used.
"""

from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass, replace
from typing import Any, ContextManager

import numpy as np

__all__ = [
    "DeviceSpec",
    "parse_device",
    "canonicalize",
    "is_gpu",
    "device_index",
    "array_module",
    "to_device",
    "device_of",
    "device_scope",
    "cupy_or_none",
    "num_gpus",
    "host_device",
    "is_cupy_array",
    "is_device_buffer",
    "synchronize_producer",
    "default_local_devices",
    "device_list",
]

_DEVICE_TYPES = {"CPU": "CPU", "GPU": "GPU"}
_FIELD_RE = re.compile(
    r"^(?:(?P<job>job:[A-Za-z0-9_\-]+)|(?P<replica>replica:\d+)|(?P<task>task:\d+)"
    r"|(?P<device>device:(?P<dtype1>[A-Za-z]+):(?P<dindex1>\d+|\*))"
    r"|(?P<short>(?P<dtype2>[A-Za-z]+)(?::(?P<dindex2>\d+|\*))?))$"
)


@dataclass(frozen=True)
class DeviceSpec:
    """A parsed device name. ``device_type`` is "CPU" or "GPU"."""

    job: str = "localhost"
    replica: int = 0
    task: int = 0
    device_type: str = "CPU"
    device_index: int = 0

    def to_string(self) -> str:
        """The canonical, fully qualified device string."""
        return (
            f"/job:{self.job}/replica:{self.replica}/task:{self.task}"
            f"/device:{self.device_type}:{self.device_index}"
        )

    def replace(self, **changes: Any) -> "DeviceSpec":
        """A copy with some fields changed."""
        return replace(self, **changes)

    def __str__(self) -> str:
        return self.to_string()


def _malformed(device: Any, why: str) -> ValueError:
    return ValueError(
        f"Malformed device string {device!r}: {why}. Expected forms like '/cpu:0', "
        "'/gpu:1', 'GPU:0', '/device:CPU:0' or '/job:worker/replica:0/task:1/device:GPU:0'."
    )


def parse_device(device: "str | DeviceSpec", *, job: str = "localhost", task: int = 0) -> DeviceSpec:
    """Parse a device string; missing job/replica/task take the given defaults.

    A device is named as in TensorFlow: ``"/cpu:0"``, ``"/gpu:1"``, ``"GPU:0"``,
    ``"/device:CPU:0"`` or fully qualified
    ``"/job:worker/replica:0/task:1/device:GPU:0"``. ``/cpu:K`` is valid for any K
    (logical CPU devices, several replicas in one process); ``/gpu:K`` is CUDA device K.
    """
    if isinstance(device, DeviceSpec):
        return device
    if isinstance(device, str):
        return _parse_cached(device, job, task)
    raise TypeError(f"A device must be a string like '/cpu:0', got {type(device).__name__}: {device!r}")


@functools.lru_cache(maxsize=4096)
def _parse_cached(device: str, job: str, task: int) -> DeviceSpec:
    if not isinstance(device, str):
        raise TypeError(f"A device must be a string like '/cpu:0', got {type(device).__name__}: {device!r}")
    text = device.strip()
    if not text:
        raise _malformed(device, "it is empty")
    fields: dict[str, Any] = {"job": job, "replica": 0, "task": task}
    parts = [p for p in text.split("/")]
    if parts[0] == "":
        parts = parts[1:]
    if not parts or any(p == "" for p in parts):
        raise _malformed(device, "empty component")
    seen_device = False
    for part in parts:
        m = _FIELD_RE.match(part)
        if not m:
            raise _malformed(device, f"cannot understand component {part!r}")
        if m.group("job"):
            fields["job"] = part.split(":", 1)[1]
        elif m.group("replica"):
            fields["replica"] = int(part.split(":", 1)[1])
        elif m.group("task"):
            fields["task"] = int(part.split(":", 1)[1])
        else:
            if seen_device:
                raise _malformed(device, "more than one device component")
            seen_device = True
            dtype = (m.group("dtype1") or m.group("dtype2")).upper()
            index = m.group("dindex1") or m.group("dindex2") or "0"
            if dtype not in _DEVICE_TYPES:
                raise _malformed(device, f"unknown device type {dtype!r} (only CPU and GPU)")
            if index == "*":
                index = "0"
            fields["device_type"] = _DEVICE_TYPES[dtype]
            fields["device_index"] = int(index)
    if not seen_device:
        raise _malformed(device, "no device type (CPU or GPU) given")
    return DeviceSpec(**fields)


def canonicalize(device: "str | DeviceSpec", *, job: str = "localhost", task: int = 0) -> str:
    """``"/gpu:1"`` -> ``"/job:localhost/replica:0/task:0/device:GPU:1"``."""
    return parse_device(device, job=job, task=task).to_string()


def is_gpu(device: "str | DeviceSpec") -> bool:
    """Whether the device is a GPU."""
    return parse_device(device).device_type == "GPU"


def device_index(device: "str | DeviceSpec") -> int:
    """The device's index (K in ``/gpu:K``)."""
    return parse_device(device).device_index


def default_local_devices() -> list[str]:
    """Every GPU CuPy sees, else one CPU device (what a strategy replicates on when not told)."""
    n = num_gpus()
    return [f"/gpu:{i}" for i in range(n)] if n else ["/cpu:0"]


def device_list(devices: Any, what: str) -> list[str]:
    """``devices`` as a non-empty list (ValueError naming the argument ``what`` for a string or nothing)."""
    if isinstance(devices, str):
        raise ValueError(f"`{what}` must be a list of device strings, got the string {devices!r}")
    devices = list(devices)
    if not devices:
        raise ValueError(f"`{what}` must not be empty")
    return devices


def host_device(task: int = 0, job: str = "localhost") -> str:
    """The canonical CPU:0 device of a task."""
    return DeviceSpec(job=job, task=task).to_string()


def cupy_or_none():
    """The ``cupy`` module if it imports and sees a CUDA device, else None."""
    try:
        import cupy  # noqa: PLC0415

        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:  # ImportError, CUDA driver errors
        return None


def num_gpus() -> int:
    """How many CUDA devices CuPy sees (0 without CuPy or a GPU)."""
    cp = cupy_or_none()
    return 0 if cp is None else int(cp.cuda.runtime.getDeviceCount())


def _require_cupy(device: str):
    try:
        import cupy  # noqa: PLC0415
    except ImportError as exc:
        raise RuntimeError(
            f"Device {device!r} is a GPU but CuPy is not installed; install mpistrat[cuda12] "
            "or mpistrat[cuda13], or use a '/cpu:K' device."
        ) from exc
    return cupy


def array_module(device: "str | DeviceSpec"):
    """The array module for a device: ``numpy`` for CPU, ``cupy`` for GPU."""
    spec = parse_device(device)
    if spec.device_type == "GPU":
        return _require_cupy(str(device))
    return np


def is_cupy_array(x: Any) -> bool:
    """Whether ``x`` is a CuPy ndarray (without importing CuPy)."""
    kind = type(x)
    return kind is not np.ndarray and kind.__module__.startswith("cupy") and hasattr(x, "__cuda_array_interface__")


def is_device_buffer(x: Any) -> bool:
    """Whether ``x`` exposes ``__cuda_array_interface__`` (device memory: CuPy arrays and others)."""
    return not isinstance(x, np.ndarray) and hasattr(x, "__cuda_array_interface__")


def synchronize_producer(x: Any) -> None:
    """Wait until the work producing the device buffer ``x`` on its stream has finished.

    CuPy arrays: the current stream is synchronised. Other producers: the
    ``stream`` of their ``__cuda_array_interface__`` (version 3), if given.
    """
    if is_cupy_array(x):
        import cupy  # noqa: PLC0415

        cupy.cuda.get_current_stream().synchronize()
        return
    stream = x.__cuda_array_interface__.get("stream")
    if stream is None or stream == 0:
        return  # no stream given / legacy default stream semantics
    import cupy  # noqa: PLC0415

    cupy.cuda.ExternalStream(int(stream)).synchronize()


_HOST_CANONICAL = DeviceSpec().to_string()
_NO_SCOPE = contextlib.nullcontext()  # stateless: one object serves every CPU scope, in every thread


def device_of(x: Any) -> str:
    """The canonical device an array lives on (NumPy arrays and scalars: CPU:0)."""
    if is_cupy_array(x):
        return DeviceSpec(device_type="GPU", device_index=int(x.device.id)).to_string()
    return _HOST_CANONICAL


def device_scope(device: "str | DeviceSpec") -> ContextManager[Any]:
    """A context manager making ``device`` current for CuPy (a no-op for CPU devices)."""
    spec = parse_device(device)
    if spec.device_type != "GPU":
        return _NO_SCOPE
    cupy = _require_cupy(str(device))
    return cupy.cuda.Device(spec.device_index)


def to_device(x: Any, device: "str | DeviceSpec", *, copy: bool = False) -> Any:
    """Place ``x`` (array, scalar or nested list) on ``device``.

    CPU: a NumPy array (CuPy arrays are copied to the host). GPU K: a CuPy
    array on device K. With ``copy=True`` the result never shares memory with
    ``x``.
    """
    spec = parse_device(device)
    if spec.device_type == "GPU":
        cupy = _require_cupy(str(device))
        with cupy.cuda.Device(spec.device_index):
            if copy or not (is_cupy_array(x) and x.device.id == spec.device_index):
                return cupy.array(x, copy=True)
            return x
    if is_cupy_array(x):
        return x.get()
    return np.array(x, copy=True) if copy else np.asarray(x)
