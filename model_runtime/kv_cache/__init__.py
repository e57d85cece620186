"""Paged KV cache: pure block bookkeeping (``block_pool``, ``manager``) and the torch tensors (``tensors``)."""
