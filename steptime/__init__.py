"""How long a step takes: the step-time models shared by emulated workers, the router's
predictions, the simulator and the planner (pure Python, standard library only).

- ``model``: the ``StepTimeModel`` protocol and the chunk features every model reads;
- ``roofline``: ``RooflineProfile``, a GPU's time from FLOPs and bytes (the built-ins);
- ``fitted``: ``FittedProfile``, coefficients fitted to a real engine's steps (``pdserve profile``);
- ``dilation``: ``Dilated``, any model with every duration stretched (``<profile>@x<factor>``);
- ``parallel``: any model at a tensor-parallel degree (``<profile>@tp<N>``);
- ``load``: ``load_profile``, a built-in by name or a JSON file of either kind.

What a serving host adds on top of a model (the simulator's calibration: service factors,
co-activity, step-time jitter, host speed) wraps a model in ``pdserve.simulator.calibration``.
"""
