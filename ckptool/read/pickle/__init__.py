"""The safety kernel: what loading a pickle would call, modelled.

``torch.load(weights_only=False)`` runs what CPython's unpickler calls
(REDUCE, NEWOBJ, INST/OBJ, BUILD's ``__setstate__``, APPENDS' ``extend`` and
``append``, ADDITEMS' ``add``, each looked up as CPython looks it up) and
whatever those callees call in turn. This folder holds the model of that:

- ``calls``: the table of callables ckptool models, each with what the real
  one does with its arguments (stores them, calls one, creates an object of
  one, reads a mapping whose ``__missing__`` may call a factory), and
  ``callables_in``, which finds the values a call could run;
- ``lookups``: the attributes a BUILD puts on an instance that CPython then
  looks up there (an injected ``__setstate__``, ``append``, ``extend``,
  ``add``), as ``getattr(inst, name)`` finds them;
- ``torchscript``: the code of a TorchScript archive (``code/``), which
  ``torch.jit.load`` runs without any pickle: the ops each ``__setstate__``
  calls, judged against a small list of pure tensor ops.

The unpickler (``ckptool.read.pickle.unpickler``) drives it and ``ckptool.read.pickle.policy``
turns what was recorded into verdicts. A reference that nothing calls is
data; anything this table does not model is unknown, and unknown fails
closed for ``load``, ``fix`` and ``convert``.
"""
