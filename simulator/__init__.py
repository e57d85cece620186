"""The event simulator: a discrete-event simulation of a pdserve cluster.

It runs the real scheduling code — the role engines with ``model_runtime``'s schedulers and block
managers, the router's policies — against the same latency model as the emulated workers
(``pdserve.steptime``), KV hand-off time included, so a layout can be judged at a scale no test
machine holds. Pure Python: no torch, no Ray, no sockets. ``pdserve simulate`` and ``pdserve
plan`` (``pdserve.planning``) are what run it.
"""
