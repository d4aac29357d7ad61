"""The safety kernel: what loading a pickle would call, modelled.

``torch.load(weights_only=False)`` runs what CPython's unpickler calls
(REDUCE, NEWOBJ, INST/OBJ, BUILD's ``__setstate__``, APPENDS' ``extend`` and
``append``, ADDITEMS' ``add``, each looked up as CPython looks it up) and
whatever those callees, and the classes of the objects they touch, call in
turn. This folder holds the model of that, in reading order:

- ``unpickler``: the pickle reader that never imports or calls what the file
  names; it drives the rest;
- ``calls``: the table of callables ckptool models, each with what the real
  one does with its arguments (stores them, calls one, creates an object of
  one, reads a mapping whose ``__missing__`` may call a factory), the pure
  functions, and the bounded walks;
- ``reach``: REDUCE, INST and OBJ, and the calls the real code makes later
  (a partial's target, a factory, an injected ``__setstate__``);
- ``lookups``: what a BUILD puts on an object, looked up there as CPython
  does, and reached wherever the object is touched (given to a call, hashed,
  a SETITEM target, a state) by its class's own code;
- ``names`` and ``policy``: the world each global's name belongs to, and
  the verdict from what loading does with it;
- ``torchscript``: the code of a TorchScript archive (``code/``), which
  ``torch.jit.load`` runs without any pickle: the ops each ``__setstate__``
  calls, judged against a small list of pure tensor ops.

A reference that nothing calls is data; anything this model does not cover
is unknown, and unknown fails closed for ``load``, ``fix`` and ``convert``.
"""
