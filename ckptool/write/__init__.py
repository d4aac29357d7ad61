"""Rewriting checkpoints: ``fix`` and ``convert``, as one pipeline of stages,
each a module the driver (``fix/run.py``, ``convert/run.py``) calls in turn:

1. read: ``ckptool.read`` (``fix`` reads faithfully, so that every
   stand-in can be written back as it was);
2. plan: ``fix.plan`` (``FixOptions`` applied to the object tree; ``fix.preview``
   plans from a checkpoint already read, for ``diagnose`` and the browser);
3. lay out: ``layout`` (where every byte of the output comes from: bytes in
   memory, ranges of the input, bytes made on the way), by output format in
   ``formats/`` (``torch_zip``, ``torch_legacy``, ``safetensors``), with
   ``repickle`` (the pickle written back) and ``zipwriter`` (zip records);
4. copy: ``copy`` (writes any layout: ranges of the input through a
   mapping, ``mapcopy``, or read ahead, ``gather``; made bytes), every byte
   read once and written once;
5. verify: ``verify`` (every byte CRC-checked as it is written, by
   ``bytecheck``, from the bytes written; the output's records read back and
   compared with the plan);
6. commit: ``commit`` (a temporary file, renamed into place only once
   verified; durable where it replaces a file).

``fix.inplace`` is the one other path: ``fix --in-place`` that rewrites only a
zip's pickle.

Checkpoints of many files: ``convert.plan`` (what a conversion writes),
``sources`` (each tensor's bytes from a file, a shard or DCP chunks),
``convert.files`` (one output file), ``convert.directory`` (a directory: HF shards
split by ``shards``, or DCP through torch's writer), ``outdir`` (a
directory that appears whole or not at all), ``fix.shards`` (``fix`` on HF
shards), ``fix.dcp`` (``fix`` on a DCP directory); ``results`` holds what
``fix`` and ``convert`` report. Beside the stages: ``failures`` (a write
the system refuses, named), ``interrupt`` (what a Ctrl-C during an in-place
change left), ``flagged`` (unsafe input refused, or salvaged).
May import the top level and ``ckptool.read``.
"""
