"""One module per operation: the readable torch reference of each op (the oracle of its fast path)."""
