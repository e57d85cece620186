"""Tensor parallelism: how a model splits across the ranks of one worker (``sharding``), how KV
moves between workers of different degrees (``reshard``), and the ranks' process group."""
