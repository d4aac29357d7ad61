"""Megatron-LM, Megatron-core and NeMo checkpoints, read without Megatron.

- ``names``: what Megatron's save directories are called (the tracker file,
  ``iter_NNNNNNN``, ``mp_rank_XX[_YYY[_ZZZ]]``) and ``metadata.json``;
- ``facts``: the run's sizes from the ``args`` Namespace a checkpoint
  stores (tensor, pipeline, expert and virtual pipeline parallel sizes,
  layers, the vocabulary and its padding);
- ``stacked``: the stacked layers of a ``torch_dist`` checkpoint (every
  ``decoder.layers.*`` tensor has the layers on a leading axis);
- ``layout``: which folder and files of a save directory are the checkpoint;
- ``rules`` and ``legacy``: the legacy per-rank files
  (``mp_rank_XX_YYY/model_optim_rng.pt``) joined by Megatron's conventions;
- ``hfmap``: the Hugging Face model a Megatron GPT model is (Llama, GPT-2,
  Mixtral, Qwen2-MoE): each tensor transformers loads, as a
  ``ckptool.read.derived.Derived`` of a Megatron tensor, and its config.json.

Nothing here imports Megatron or runs code from the files: the ``args``
Namespace and Megatron's own classes in a pickle are read as inert data.
"""
