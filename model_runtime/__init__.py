"""The model runtime shared by prefill and decode workers.

Layers, from pure to I/O:

* ``request``, ``sampling_params``, ``kv_cache.block_pool``, ``kv_cache.manager``,
  ``scheduler.*``, ``sampling.stop``: pure Python bookkeeping (no torch), unit-tested directly.
* ``model.*``, ``kv_cache.tensors``, ``sampling.sampler``: torch code that runs on CPU and CUDA.
* ``engine.*``: thin shells that drive the schedulers and the model.
"""
