"""Generated stubs of proto/pdserve/v1/inference.proto; regenerate with ``python proto/generate.py``."""
