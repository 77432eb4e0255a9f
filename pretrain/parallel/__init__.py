"""Distributed building blocks: the device mesh (``dims``, ``config``), FSDP2 (``fsdp``), Ulysses sequence
parallelism (``ulysses``, ``sequence``, with differentiable collectives in ``comm``), data sharding and
per-sample gathers (``data``), full-weight export from shards (``export``) and process-group start-up
(``launch``). Every piece runs on CPU with gloo as on GPUs with NCCL."""
