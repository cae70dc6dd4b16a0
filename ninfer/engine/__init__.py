"""The engine: the public LLM API and the generation loop (later: scheduler, paged KV, CUDA graphs)."""
