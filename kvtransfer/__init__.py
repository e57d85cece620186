"""KV transfer between workers: moves paged KV blocks (``pdserve.model_runtime.kv_cache``) from a prefill
worker's pool into blocks a decode worker reserved, over NCCL, CUDA IPC, shared memory or TCP.

Entry point: ``pdserve.kvtransfer.transport.KVTransport``. Pure pieces: ``states`` (transfer state
machine, completions, counters) and ``wire`` (bounded, schema-checked msgpack frames).
"""
