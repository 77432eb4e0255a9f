"""Distributed building blocks: the device mesh (``dims``, ``config``), FSDP2 (``fsdp``), Ulysses sequence
parallelism (``sequence`` installs a model adapter's own plan; differentiable collectives in ``comm``), data
sharding and per-sample gathers (``data``), full-weight export from shards (``export``) and process-group
start-up (``launch``). Every piece runs on CPU with gloo as on GPUs with NCCL. Nothing here imports model
code: a model is reached only through its adapter's ``blocks()`` and ``sequence_parallel(group)``."""
