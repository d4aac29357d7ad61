"""Archives read in place: a tar file (a NeMo ``.nemo``) presented to the
readers as a read-only folder whose files are byte ranges of the archive.

- ``mounts``: which archives are open as folders, and which one a path lies
  in (``ckptool.read.fs`` asks it first, before the local and remote file
  systems); nothing else, so that ``fs`` imports no tar reader;
- ``tar``: an uncompressed tar's member index, read once from its headers
  (members' bytes are never read), checked (no name outside the archive, no
  link, no name twice, every member inside the file), and the questions
  ``fs`` asks of a folder answered from it;
- ``window``: a member's bytes as a seekable read-only file, reads at
  absolute offsets of the archive.
"""
