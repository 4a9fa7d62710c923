"""How training is spread over processes (``train.sharding``): a strategy object picked once
(:func:`flowrl.distributed.strategy.strategy_for`) that prepares the model, clips, saves and loads
checkpoints, and says where evaluation runs; FSDP2 itself is :mod:`flowrl.distributed.fsdp`."""
