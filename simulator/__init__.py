"""``pdserve simulate``: a discrete-event simulator of a pdserve cluster.

It runs the real scheduling code — ``model_runtime``'s schedulers and block managers, the
router's policies — against the same latency model as the emulated workers
(``pdserve.steptime``), KV hand-off time included, so a layout can be judged at a scale
no test machine holds. Pure Python: no torch, no Ray, no sockets.
"""
