"""pdserve: disaggregated prefill/decode LLM serving. The ``pdserve`` command lives in ``pdserve.cli``."""

__version__ = "0.1.0"
