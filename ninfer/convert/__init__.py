"""Converters: source readers, the Qwen3.5 plan, recipes, the streaming converter and synthetic artifacts."""
