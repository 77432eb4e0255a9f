"""Distributed building blocks: the device mesh (``dims``), FSDP2 (``fsdp``), Ulysses sequence
parallelism (``ulysses``, ``sequence``), autograd collectives (``comm``) and full-weight export
(``export``). Every piece runs on CPU with gloo as on GPUs with NCCL."""
