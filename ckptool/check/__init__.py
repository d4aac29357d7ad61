"""What is wrong with a checkpoint, and how two differ: pure analysis over
``Checkpoint``s, for the CLI, the browser and Python callers.

- ``diagnosis`` runs the checks of ``findings`` (one function per kind of
  problem) and plans their fix as one checked command (``fixcommand``);
- ``loadcheck`` predicts what plain ``torch.load`` does on a machine;
  ``gpus/`` finds the machine's GPUs as torch numbers them (``machine``;
  ``listing`` asks NVML or nvidia-smi), ``gpus.scheduler`` maps a SLURM
  job's or a container's GPUs onto them, ``gpus.order`` orders them for a
  new process's ``CUDA_VISIBLE_DEVICES`` and ``gpus.dataparallel`` checks
  a DataParallel plan's ``device_ids``; ``explain/`` reads pasted errors;
  ``placement``
  says where to load a checkpoint here; ``manyfiles`` says how a checkpoint
  of many files loads (its loader, its devices, DCP's entry prefix);
  ``zerofix`` says what a DeepSpeed checkpoint needs (a ``convert``, then
  any ``fix``) as one command;
- ``modelspec`` builds the keys a model expects (on the meta device) and
  ``reconcile`` compares them with a state dict's;
- ``diff`` and ``tensor_compare`` compare two checkpoints; ``stats``
  computes one tensor's statistics.

May import the top level, ``ckptool.read`` and ``ckptool.write`` (a fix
command is checked by planning it) and nothing above.
"""
