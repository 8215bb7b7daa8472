"""TPUStrategy: TF's name, refused at construction with what to use instead (issue 25)."""

import pytest

import mpistrat as ms


@pytest.mark.parametrize("cls", [ms.TPUStrategy, ms.experimental.TPUStrategy])
def test_constructing_tpu_strategy_raises_and_names_the_alternatives(cls):
    # TF: tpu_strategy.py TPUStrategyV2(tpu_cluster_resolver=None, experimental_device_assignment=None,
    # experimental_spmd_xla_partitioning=False) is exported as tf.distribute.TPUStrategy (and TPUStrategy under
    # tf.distribute.experimental); mpistrat keeps the names and signature but has no TPU runtime.
    assert issubclass(cls, ms.Strategy)
    with pytest.raises(NotImplementedError) as info:
        cls(None, experimental_device_assignment=None)
    message = str(info.value)
    assert "mpistrat drives no TPUs" in message
    assert "MultiWorkerMirroredStrategy" in message and "MirroredStrategy" in message
