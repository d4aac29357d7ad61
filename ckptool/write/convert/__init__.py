"""``ckptool convert``: what a conversion writes, decided first (``plan``),
one output file (``files``), a directory of shards or DCP (``directory``),
and the driver that reads the input and runs the stages (``run``).
"""
