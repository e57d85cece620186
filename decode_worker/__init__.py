"""Decode worker: reserves KV blocks for incoming requests, receives their KV from a prefill
worker, and generates tokens with ``model_runtime``'s continuous-batching decode scheduler."""
