"""``pdserve bench``: an open-loop load generator with ``vllm bench serve``'s flags and metrics.

``workload`` builds the requests (lengths, arrivals, traces; pure), ``metrics`` turns what the
client saw into the field's numbers (pure), ``client`` talks to an endpoint (OpenAI HTTP or
pdserve gRPC), ``runner`` schedules the arrivals and reports.
"""
