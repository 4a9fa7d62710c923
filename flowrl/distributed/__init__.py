"""How training is spread over processes (``train.sharding``, ``train.context_parallel``, ``train.offload``):
a strategy object picked once (:func:`flowrl.distributed.strategy.strategy_for`) that prepares the model,
clips, saves and loads checkpoints, and says where evaluation runs; FSDP2 itself is
:mod:`flowrl.distributed.fsdp`, the data-parallel x context-parallel layout :mod:`flowrl.distributed.mesh`,
context parallelism :mod:`flowrl.distributed.context` (ring attention under the native backend:
:mod:`flowrl.distributed.ring`), what lives in host memory :mod:`flowrl.distributed.offload`."""
