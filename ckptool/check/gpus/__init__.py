"""The GPUs of this machine as torch would see them: the driver's list
(``listing``), ``CUDA_VISIBLE_DEVICES`` and the probe (``machine``), a
scheduler's or container's allocation (``scheduler``), the order to export
(``order``), and a planned ``nn.DataParallel`` checked (``dataparallel``).
"""
