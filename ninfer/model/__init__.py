"""Model architectures on the reference operations: config, weight binding from an artifact, Qwen3.5."""
