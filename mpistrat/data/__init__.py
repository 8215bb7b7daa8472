"""``mpistrat.data``: tf.data-like datasets, file readers, and distributed input.

Sources: ``Dataset.range``, ``from_tensor_slices``, ``from_tensors``, ``from_generator``,
``list_files``, ``TFRecordDataset``, ``TextLineDataset``, ``NpyDataset``.
Distributed datasets (``mpistrat.data.distribute``) are made by the strategies.
"""

from . import experimental
from .dataset import AUTOTUNE, Dataset, NpyDataset, TextLineDataset, TFRecordDataset
from .errors import DataLossError, InputPipelineError, OutOfRangeError
from .example import FixedLenFeature, VarLenFeature, decode_example, encode_example, parse_single_example
from .options import AutoShardPolicy, DistributeOptions, Options
from .spec import TensorSpec
from .tfrecord import TFRecordOptions, TFRecordWriter, tf_record_iterator

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
]
