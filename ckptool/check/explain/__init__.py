"""``ckptool explain``: errors found in a log (``scan``), each read by its
pattern (``patterns``) with the text around it (``context``), what it means
and its fix (``findings``; GPU placement errors in ``gpu``), and the report
with ``diagnose`` run for the machine the error implies (``run``).
"""
