"""Device strings, placement and array backends."""

import numpy as np
import pytest

from mpistrat import devices as dev


@pytest.mark.parametrize(
    "text, expected",
    [
        ("/cpu:0", "/job:localhost/replica:0/task:0/device:CPU:0"),
        ("/gpu:1", "/job:localhost/replica:0/task:0/device:GPU:1"),
        ("GPU:0", "/job:localhost/replica:0/task:0/device:GPU:0"),
        ("cpu:3", "/job:localhost/replica:0/task:0/device:CPU:3"),
        ("/device:CPU:0", "/job:localhost/replica:0/task:0/device:CPU:0"),
        ("/job:worker/replica:0/task:1/device:GPU:0", "/job:worker/replica:0/task:1/device:GPU:0"),
        ("/job:worker/task:2/device:cpu:1", "/job:worker/replica:0/task:2/device:CPU:1"),
        ("/CPU", "/job:localhost/replica:0/task:0/device:CPU:0"),
    ],
)
def test_canonicalize(text, expected):
    assert dev.canonicalize(text) == expected
    assert dev.canonicalize(expected) == expected  # idempotent


def test_defaults_for_job_and_task():
    assert dev.canonicalize("/gpu:2", job="worker", task=3) == "/job:worker/replica:0/task:3/device:GPU:2"


@pytest.mark.parametrize("bad", ["", "/", "/tpu:0", "/cpu:x", "/job:w//device:CPU:0", "/cpu:0/gpu:1", "/job:worker", 5])
def test_malformed_device_strings_raise(bad):
    with pytest.raises((ValueError, TypeError)) as info:
        dev.parse_device(bad)
    assert repr(bad) in str(info.value) or "device must be a string" in str(info.value)


def test_spec_fields_and_helpers():
    spec = dev.parse_device("/job:worker/replica:0/task:1/device:GPU:2")
    assert (spec.job, spec.task, spec.device_type, spec.device_index) == ("worker", 1, "GPU", 2)
    assert dev.is_gpu("/gpu:0") and not dev.is_gpu("/cpu:0")
    assert dev.device_index("/cpu:7") == 7
    assert str(spec.replace(task=0)) == "/job:worker/replica:0/task:0/device:GPU:2"


def test_cpu_backend_and_placement():
    assert dev.array_module("/cpu:1") is np
    x = [1.0, 2.0]
    y = dev.to_device(x, "/cpu:0")
    assert isinstance(y, np.ndarray) and y.tolist() == x
    a = np.arange(3)
    assert dev.to_device(a, "/cpu:0") is a
    b = dev.to_device(a, "/cpu:1", copy=True)
    assert b is not a and np.array_equal(a, b) and not np.shares_memory(a, b)
    assert dev.device_of(a) == "/job:localhost/replica:0/task:0/device:CPU:0"
    assert dev.device_of(3.0) == "/job:localhost/replica:0/task:0/device:CPU:0"


def test_gpu_device_without_cupy_says_so():
    if dev.num_gpus():
        pytest.skip("a GPU is present; this checks the message when there is none")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="CuPy is not installed"):
            dev.array_module("/gpu:0")
    else:
        pytest.skip("CuPy is installed; this checks the message when it is not")


@pytest.mark.gpu
def test_gpu_placement_roundtrip():
    import cupy

    x = dev.to_device(np.arange(4.0), "/gpu:0")
    assert isinstance(x, cupy.ndarray) and x.device.id == 0
    assert dev.device_of(x) == "/job:localhost/replica:0/task:0/device:GPU:0"
    assert dev.to_device(x, "/cpu:0").tolist() == [0.0, 1.0, 2.0, 3.0]
    assert dev.array_module("/gpu:0") is cupy
