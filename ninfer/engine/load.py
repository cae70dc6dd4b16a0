"""Load an artifact's text model as a `Model` the engine runs: the packed GPU model (through its graph runner) on
CUDA when the model's shapes suit its kernels, else the torch reference model."""

from __future__ import annotations

import torch

from ninfer.artifact.reader import Artifact
from ninfer.config import FAST_DEFAULT_CONTEXT, CacheConfig, EngineConfig
from ninfer.devices import free_memory
from ninfer.errors import NinferError
from ninfer.model.config import TextConfig
from ninfer.model.protocol import Model
from ninfer.model.qwen3_5 import Qwen35Model


def fast_path_unsupported(config: TextConfig, device: torch.device) -> str | None:
    """Why the packed GPU model cannot run this model here, or None when it can."""
    if device.type != "cuda":
        return "it runs on CUDA only"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "the triton package is not installed"
    if config.head_dim < 64 or config.head_dim & (config.head_dim - 1):
        return f"the attention head_dim {config.head_dim} is not a power of two of at least 64"
    return None


def context_of(config: TextConfig, engine: EngineConfig, packed: bool) -> int:
    """The context a model serves: the configured one, else the model's (at most FAST_DEFAULT_CONTEXT on the packed
    GPU model, whose KV pool is planned for it), never beyond the model's positions."""
    default = min(FAST_DEFAULT_CONTEXT, config.max_positions) if packed else config.max_positions
    return min(engine.cache.max_context or default, config.max_positions)


def load_model(artifact: Artifact, engine: EngineConfig, device: torch.device, dtype: torch.dtype, *,
               graphs: bool = True, max_verify_tokens: int = 0, int8_activations: bool = True,
               progress: bool = False) -> tuple[Model, int]:
    """The artifact's text model as the engine's `Model`, and its context length. With `spec="mtp"` its sequences
    carry the MTP head's state, so that the model drafts."""
    config = TextConfig.from_dict(artifact.components["text"]["config"])
    runner = engine.runtime.runner
    reason = fast_path_unsupported(config, device)
    if runner == "fast" and reason:
        raise NinferError(f"the fast path cannot run this model: {reason}")
    drafter = engine.speculative.spec == "mtp"
    if drafter and "mtp" not in artifact.components:
        raise NinferError(f"--spec mtp needs an MTP head, and {artifact.path.name} has no mtp component; "
                          "use --spec none")
    if engine.speculative.lm_head_draft and "text/draft_head" not in {o.id for o in artifact.objects}:
        raise NinferError(f"--lm-head-draft needs a proposal head, and {artifact.path.name} has none; add one with "
                          "`ninfer draft-head`")
    if drafter and runner != "reference" and reason is None:
        raise NinferError("speculative decoding runs on the reference runner so far: add --runner reference")
    cache_config = engine.cache
    packed = runner != "reference" and reason is None
    context = context_of(config, engine, packed)
    if not packed:
        model = Qwen35Model.from_artifact(artifact, device, dtype, drafter=drafter,
                                          draft_head=engine.speculative.lm_head_draft)
        model.kv_capacity = cache_config.kv_capacity or cache_config.sequences * context
        return model, context
    return load_packed(artifact, cache_config, context, device, dtype, graphs=graphs,
                       max_verify_tokens=max_verify_tokens, int8_activations=int8_activations,
                       progress=progress), context


def load_packed(artifact: Artifact, cache_config: CacheConfig, context: int, device: torch.device,
                dtype: torch.dtype, *, graphs: bool = True, max_verify_tokens: int = 0, int8_activations: bool = True,
                progress: bool = False) -> Model:
    """The packed GPU model behind its graph runner: the memory plan first (refusing what does not fit before
    loading anything), then the pools, then the weights. `max_verify_tokens` > 0 reserves GDN snapshot slots for
    verify steps of up to that many draft tokens per sequence; `graphs=False` runs every step eagerly."""
    from ninfer.engine.kv_cache import KVCache
    from ninfer.engine.memory import plan_memory
    from ninfer.engine.runner import GraphRunner
    from ninfer.model.qwen3_5_packed import PackedQwen35, device_bytes

    config = TextConfig.from_dict(artifact.components["text"]["config"])
    use_graphs = graphs and device.type == "cuda"
    plan = plan_memory(config, device_bytes(artifact), free_memory(device), slots=cache_config.sequences,
                       max_context=context, kv_capacity=cache_config.kv_capacity, kv_dtype=cache_config.kv_dtype,
                       prefill_chunk=cache_config.prefill_chunk, state_dtype=cache_config.state_dtype,
                       max_verify_tokens=max_verify_tokens, decode_graphs=use_graphs)
    cache = KVCache(config, device, slots=cache_config.sequences, kv_tokens=plan.kv_tokens, max_context=context,
                    kv_dtype=cache_config.kv_dtype, float_dtype=dtype, state_dtype=cache_config.state_dtype,
                    max_verify_tokens=max_verify_tokens)
    packed = PackedQwen35.load(artifact, cache, dtype=dtype, prefill_chunk=cache_config.prefill_chunk,
                               int8_activations=int8_activations, progress=progress)
    return GraphRunner(packed, cache, plan, graphs=use_graphs)
