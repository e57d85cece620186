"""Paged KV cache: pure bookkeeping (``block_pool``, ``manager``) and the torch tensors (``tensors``)."""
