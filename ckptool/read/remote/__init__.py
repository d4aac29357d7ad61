"""Checkpoints behind a URL, read by ranges without downloading them.

``hf://org/model[@revision][/path]``, ``s3://bucket/key``, ``gs://bucket/key``
and ``http(s)://host/path`` are read through fsspec, the ecosystem's common
file layer (torch DCP's ``FsspecReader`` uses it too), each scheme by its
own library, an optional dependency named by the error when missing
(``stores``). The rest of ``ckptool.read`` reaches them through
``ckptool.read.fs`` exactly as it reaches local files:

- ``urls``: telling a URL from a path, and showing one without credentials;
- ``stores``: the fsspec filesystem of a scheme, its credentials from the
  library's usual places, and its failures said as ckptool errors;
- ``tree``: a folder's names and sizes from one listing, so that finding
  out what a remote folder holds costs requests once, not per question;
- ``rfile``: a remote file as a seekable binary file, each read a range
  request sized to what the formats read (``SPECULATIVE`` bytes for a
  header, the exact range for a pickle or a tensor), pinned to the version
  first seen;
- ``counts``: the requests and bytes a command made, for ``--json`` and
  ``-v``.
"""


def forget() -> None:
    """Start afresh: no listing, no piece of a file and no count kept from
    before (``ckptool.open`` of a URL calls it: a folder listed an hour ago
    in a long-lived process may hold new files now)."""
    from ckptool.read.remote import counts, hubrepo, rfile, stores, tree

    tree.forget()
    hubrepo.forget()
    rfile.forget()
    counts.reset()
    for fs in stores.made():
        fs.invalidate_cache()
