"""pdserve: disaggregated prefill/decode LLM serving, one import name for the whole system.

Rooms: ``pdserve.router``, ``pdserve.worker``, ``pdserve.prefill_worker``, ``pdserve.decode_worker``,
``pdserve.kvtransfer``, ``pdserve.model_runtime``, ``pdserve.steptime``, ``pdserve.deploy``,
``pdserve.simulator``, ``pdserve.planning`` (links to the repository's top-level folders); the
``pdserve`` command lives in ``pdserve.cli``.
"""

__version__ = "0.1.0"
