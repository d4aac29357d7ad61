"""The safe reading layer: a file in, a pure ``Checkpoint`` out, and nothing
from the file ever run.

- the pickle layer: ``unpickler`` (a pickle reader that never imports or
  calls what the file names), ``observe`` (state dicts seen while they are
  read), ``policy`` (what naming a global means), ``resolve`` (what each
  global becomes), ``values`` and ``constructors`` (inert stand-ins and the
  few containers built for real), ``tensors`` (tensor and storage records,
  in place of torch's rebuild functions), ``treecheck`` (bounds on the tree);
- ``dispatch``: which reader a file calls for, sniffed by content, and the
  "what is this file" errors; ``formats/``: one module per file format,
  each turning a file into a ``RawRead``; ``ziparchive`` reads zip
  directories; ``frames`` and ``pickles`` find a file's pickles;
- ``companions``: the framework folder a checkpoint was read from and
  every other file in it; ``optim``: optimizer states wherever they sit;
  ``ties``: the name a writer keeps of tied ones, and the ties a file
  records; ``params``: parameter counts;
- ``layouts/``: checkpoints of many files (a directory or an index file:
  Hugging Face shards, ``torch.distributed.checkpoint``), recognised by
  content, read with the single-file readers and the same unpickler, and
  merged into one tree; and one logical tensor's bytes from its shard or
  its chunks (``layouts.tensor_bytes``);
- the model: ``walk`` (tensors, entries and state-dict candidates of a
  tree), ``prefixes`` (wrapper prefixes), ``summary`` (short text of
  values), ``reader`` (``ckptool.open``: a ``Checkpoint``);
- ``tensor_data``: tensor bytes of a file, read on demand (``layouts.tensor_bytes``
  builds on it for many files); ``tensor_source``: values of any checkpoint's
  tensors, one file or many, for the views; ``materialize`` and
  ``placement``: ``ckptool.load``'s real tensors where ``map_location`` puts
  them.

May import the top level (``errors``, ``model``, ``dtypes``, ``describe``)
and nothing above it.
"""
