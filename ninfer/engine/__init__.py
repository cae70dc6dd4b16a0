"""The engine: sequences, scheduling, the KV cache, CUDA graphs, and `LLM`, the synchronous facade over it."""

from ninfer.engine.engine import Engine, EngineClosedError, PromptTooLongError, QueueFullError, QueueTimeoutError
from ninfer.engine.llm import LLM
from ninfer.engine.sequence import Finished, Request, Result

__all__ = ["LLM", "Engine", "EngineClosedError", "Finished", "PromptTooLongError", "QueueFullError",
           "QueueTimeoutError", "Request", "Result"]
