"""``mpistrat.data``: tf.data-like datasets, file readers, and distributed input.

Sources: ``Dataset.range``, ``from_tensor_slices``, ``from_tensors``, ``from_generator``,
``list_files``, ``TFRecordDataset``, ``TextLineDataset``, ``NpyDataset``.
Distributed datasets (``mpistrat.data.distribute``) are made by the strategies.

Where this differs from tf.data / tf.distribute, on purpose:

* Global batches under FILE and OFF sharding follow TF's ``batch_sizes_for_worker``:
  each worker's own batch of ``global_batch`` rows is cut into W*R pieces and feeds
  W consecutive steps, so every step still consumes ``global_batch`` rows over all
  replicas. A short last batch is cut by its own ``array_split`` sizes (TF fills the
  first pieces); under DATA a short global batch is also ``array_split`` over all
  replicas (see :mod:`.splitting`).
* Under DATA, shuffles and ``list_files`` without a seed get one seed agreed from
  rank 0, so every worker walks the same order (TF leaves this to the user).
* ``list_files`` yields ``str`` paths; FILE sharding of a ``list_files`` source
  splits its sorted list before shuffling, so workers never share a file.
* Ranks agree once per run of steps they all hold in memory rather than once per
  step; iteration ends, and errors are raised on every rank, at the same step.
* ``map(num_parallel_calls)`` and prefetching use threads (NumPy work releases
  the GIL; pure-Python work does not run in parallel). ``num_parallel_reads``
  reads files in interleave order (block length 1) in one thread. ``cache(filename)`` is not
  supported; ``VarLenFeature`` parses to a dense 1-D array.
* Batches are cut like ``numpy.array_split`` (DESIGN.md): 4 rows on 3 replicas give
  2, 1, 1 rows, where TF's MirroredStrategy gives 2, 2, 0 for batches of unknown size.
* ``experimental_distribute_dataset`` rejects ``experimental_place_dataset_on_device``
  (TF ignores it there); with ``distribute_datasets_from_function`` and PER_REPLICA it
  places each replica's values on its device as they are handed out.
"""

from mpistrat.data import experimental
from mpistrat.data.dataset import AUTOTUNE, Dataset, NpyDataset, TextLineDataset, TFRecordDataset
from mpistrat.data.errors import DataLossError, InputPipelineError, OutOfRangeError
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
]
