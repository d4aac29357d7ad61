"""One module per file format ckptool reads: ``torch_zip`` (torch.save's zip,
TorchScript archives), ``torch_legacy`` (torch < 1.6), ``safetensors_fmt``,
``pickle_fmt`` (a bare pickle) and ``pt2`` (a ``torch.export`` archive). Each
offers ``sniff`` and ``read(path) -> RawRead`` (``base``); which one reads a
file is ``ckptool.read.dispatch``'s choice, made from its first bytes.
"""
