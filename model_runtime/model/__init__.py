"""Llama-family model code (torch): loading, layers, paged attention."""
