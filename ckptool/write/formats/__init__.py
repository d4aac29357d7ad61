"""The output formats ``ckptool`` writes, one module each: the layout of a
file of that format (``ckptool.write.layout``), from a plan or a set of
tensors, and the format's own checks of what was written.

- ``torch_zip``: ``torch.save``'s zip, rewritten (storage records copied
  page-congruent, a new pickle) or new (``convert`` to torch);
- ``torch_legacy``: a rewritten pre-1.6 file;
- ``safetensors``: a header and the tensors' bytes.

The readers of the same formats are in ``ckptool.read.formats``.
"""
