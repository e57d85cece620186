"""Prefill worker: runs ``model_runtime``'s prefill scheduler on a compute-heavy device, samples the
first token of each request, and pushes the request's KV blocks to its decode worker."""
