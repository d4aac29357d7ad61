"""Checkpoints of many files: a directory (or an index file) read as one checkpoint.

- ``recognise``: what a path holds, by content: Hugging Face shards named by
  an index's ``weight_map`` (safetensors, or torch zip / legacy ``.bin``), a
  ``torch.distributed.checkpoint`` (DCP) directory (``.metadata`` + ``.distcp``
  files), DCP inside known wrappers (a Lightning ``.ckpt`` directory with
  ``meta.pt``; accelerate's ``pytorch_model_fsdp_0/``), a DeepSpeed
  checkpoint (a tag directory, or the one its ``latest`` names), a directory
  holding exactly one checkpoint file, or a clear error saying what was found;
- ``base``: ``MultiRead``, what a layout reader returns (one merged object
  tree, as a single file's ``RawRead``, plus its files, chunks and shards);
- ``hf_sharded``: an HF index and its shards, each read by the single-file
  readers of ``ckptool.read.formats``;
- ``dcp_metadata``: a DCP ``.metadata`` pickle, read with ckptool's own
  unpickler (never ``pickle.load``), checked into plain records;
- ``dcp``: a DCP directory as one checkpoint: logical tensors with their
  chunks, and the non-tensor values (BYTE_IO items) as entries;
- ``deepspeed_files``: a DeepSpeed tag directory's per-rank files, read with
  the single-file readers and checked against each other (ranks, world
  size, stage, step);
- ``zero``: where each parameter lies in the ranks' flat partitions (ZeRO
  1/2, the BF16_Optimizer, ZeRO 3): arithmetic on lengths only;
- ``deepspeed``: a DeepSpeed checkpoint as one checkpoint whose state dict is
  the consolidated fp32 master weights, each tensor a list of byte runs
  (``flat`` chunks) in the ranks' files;
- ``embedded``: a ``torch.save`` archive embedded in a slice of a file (each
  DCP item is one), read as a file of its own;
- ``tensor_bytes``: one logical tensor's values, read from its shard or
  reassembled from its chunks (DCP archives, or DeepSpeed's runs of raw
  elements), with memory bounded by that tensor.

``ckptool.read.reader`` turns a ``MultiRead`` into the same ``Checkpoint`` as
a single file gives, with ``directory``, ``files`` and, per tensor, ``file``
or ``chunks`` set. This package's ``__init__`` imports nothing: its
modules use the format readers (``layouts.names`` sniffs with them), and
``ckptool.read.dispatch`` uses ``recognise``, with no loop between them.
"""
