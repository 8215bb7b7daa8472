"""``mpistrat.data``: tf.data's input pipelines (datasets, file readers) on NumPy.

Sources: ``Dataset.range``, ``from_tensor_slices``, ``from_tensors``, ``from_generator``,
``list_files``, ``TFRecordDataset``, ``TextLineDataset``, ``NpyDataset``; the strategies
distribute them (``mpistrat.data.distribute``). Where this differs from tf.data and
tf.distribute, on purpose: docs/data.md.
"""

from mpistrat.data import experimental
from mpistrat.data.dataset import AUTOTUNE, Dataset, NpyDataset, TextLineDataset, TFRecordDataset
from mpistrat.data.errors import DataLossError, InputPipelineError, InvalidArgumentError, OutOfRangeError
from mpistrat.data.example import FixedLenFeature, VarLenFeature, decode_example, encode_example, parse_single_example
from mpistrat.data.options import AutoShardPolicy, DistributeOptions, Options
from mpistrat.data.spec import TensorSpec
from mpistrat.data.tfrecord import TFRecordOptions, TFRecordWriter, tf_record_iterator

__all__ = [
    "AUTOTUNE",
    "Dataset",
    "TFRecordDataset",
    "TextLineDataset",
    "NpyDataset",
    "Options",
    "DistributeOptions",
    "AutoShardPolicy",
    "experimental",
    "TensorSpec",
    "TFRecordWriter",
    "TFRecordOptions",
    "tf_record_iterator",
    "decode_example",
    "encode_example",
    "parse_single_example",
    "FixedLenFeature",
    "VarLenFeature",
    "DataLossError",
    "InputPipelineError",
    "OutOfRangeError",
    "InvalidArgumentError",
]
