"""The engine: sequences, scheduling, the KV cache, CUDA graphs, and `LLM`, the synchronous facade over it."""

from ninfer.engine.llm import LLM, Finished, PromptTooLongError
from ninfer.engine.scheduler import Engine, EngineClosedError, QueueFullError, QueueTimeoutError, Request, Result

__all__ = ["LLM", "Engine", "EngineClosedError", "Finished", "PromptTooLongError", "QueueFullError",
           "QueueTimeoutError", "Request", "Result"]
