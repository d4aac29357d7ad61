"""``ckptool fix``: rename, drop, extract, retarget and cast a checkpoint in
its own format. ``plan`` applies the options to a faithful tree, ``preview``
plans from a checkpoint already read, ``run`` drives the pipeline for one
file, ``inplace`` rewrites only a zip's pickle, and ``shards`` and ``dcp``
fix directories of Hugging Face shards and DCP (``journaled``: an in-place
fix of shards as one change); ``flags`` writes options back as a command.
"""
