"""``ckptool verify``: is a checkpoint whole and sane, in every layout.

- ``problems``: what verify reports (``Problem``, ``Report``);
- ``structure``: everything the files say about themselves, per layout
  (sizes, coverage, zip CRC-32, pickles and headers that parse), with
  ``zipcheck``, ``files``, ``hfindex``, ``dcpcheck`` and ``layouts``;
- ``hfcache``: a Hugging Face cache snapshot's blobs against their names;
  ``hubsnapshot``: the snapshot against the Hub's listing of its commit
  (``--against-hub``);
- ``values`` (reading through ``valuescan``): NaN, Inf, all-zero and
  identical tensors (``--values``);
- ``digest``, ``manifest`` (with ``filehash``: a checkpoint's files and
  their hashes): per-tensor digests and manifests.

Imports nothing: each module is imported where it is used.
"""
