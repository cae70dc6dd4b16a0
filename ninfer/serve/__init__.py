"""The HTTP server: OpenAI Chat Completions (and, when present, Responses and Anthropic Messages) over one Engine."""
