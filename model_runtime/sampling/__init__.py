"""Token selection: batched sampler (torch) and stop-string matching (pure)."""
