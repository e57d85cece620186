"""The router: front door of the cluster (gRPC and OpenAI-compatible HTTP).

Per request it picks a prefill worker and a decode worker through a routing policy, has the
decode worker reserve KV blocks, the prefill worker compute and push the KV, and streams the
decode worker's tokens back to the client.
"""
