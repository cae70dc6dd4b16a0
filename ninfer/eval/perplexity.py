"""Windowed perplexity, KL divergence against a reference model, the unigram baseline, `ninfer ppl` / `ninfer kl`.

Windows follow NInfer's `ninfer-perplexity` (fixed-window, truncated-context causal perplexity). Every window
starts from an empty state and holds at most `context` tokens. The first scores positions [1, min(context, N));
each later one begins `stride` tokens after the previous one and scores only the positions after the previous
window's end. So every position t >= 1 is scored exactly once, from at least `context - stride` tokens of left
context (fewer only in the first window). A window's first token can never be scored (nothing precedes it), so
`stride == context` advances by `context - 1`: one token of overlap.

Scores are float64: NLL = -log_softmax(logits)[target], KL(ref || model) = sum_v p_ref(v) (log p_ref(v) -
log p(v)), both from the fp32 logits over the model's whole vocabulary (padding rows included).
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from tqdm import tqdm

from ninfer.errors import NinferError

TILE = 512  # positions per forward call: bounds the [tile, V] fp32 logits (0.5 GB at Qwen3.5's V = 248,320)
SCORE_ROWS = 128  # logit rows per float64 log-softmax: bounds its temporaries (about 250 MB each at V = 248,320)


class EvalError(NinferError):
    """Token ids, window sizes or a text that cannot be evaluated, or two models that cannot be compared."""


class LogitModel(Protocol):
    """What the evaluation needs of a model: a part of the `ninfer.model.protocol.Model` protocol."""

    device: torch.device

    def new_state(self, capacity: int) -> Any: ...

    def free_state(self, state: Any) -> None: ...

    def prefill(self, ids: torch.Tensor, state: Any, all_logits: bool = False) -> torch.Tensor: ...


class Window(NamedTuple):
    """Run tokens [begin, end) from an empty state; score the targets at positions [score_from, end)."""

    begin: int
    end: int
    score_from: int


@dataclass(frozen=True)
class PerplexityResult:
    nll_sum: float  # sum over scored positions of -log p(x_t | window prefix), nats
    tokens: int  # scored positions: N - 1
    ppl: float  # exp(nll_sum / tokens)
    windows: int


@dataclass(frozen=True)
class KLResult:
    mean: float  # mean over scored positions of KL(P_ref || P_model), nats
    p99: float  # 99th percentile (linear interpolation) of the per-position KL
    max: float
    tokens: int  # scored positions: N - 1
    top1_agreement: float  # fraction of positions where both argmaxes agree
    ref_ppl: float  # perplexity of each model on the same windows
    ppl: float


def windows(n_tokens: int, context: int, stride: int) -> list[Window]:
    """The windows that score every position 1 <= t < n_tokens exactly once (module docstring); [] when
    n_tokens < 2. Raises EvalError unless 2 <= context and 1 <= stride <= context."""
    if context < 2:
        raise EvalError(f"context {context} is too small: a window needs at least 2 tokens")
    if not 1 <= stride <= context:
        raise EvalError(f"stride {stride} must lie in [1, context] = [1, {context}]")
    step = min(stride, context - 1)
    plan = []
    begin, scored_to = 0, 1
    while scored_to < n_tokens:
        end = min(begin + context, n_tokens)
        plan.append(Window(begin, end, scored_to))
        begin, scored_to = begin + step, end
    return plan


def perplexity(model: LogitModel, ids: Sequence[int] | torch.Tensor, context: int = 512, stride: int = 256,
               progress: bool = True, *, tile: int = TILE) -> PerplexityResult:
    """Perplexity of `model` on `ids` over `windows(len(ids), context, stride)`, forwarding each window in
    calls of at most `tile` positions. Raises EvalError for fewer than 2 ids or ids outside the vocabulary."""
    ids = _as_ids(ids)
    plan = _plan(len(ids), context, stride)
    nll_sum = 0.0
    with torch.inference_mode(), _bar(len(ids) - 1, "perplexity", progress) as bar:
        for window in plan:
            for targets, logits in _window_logits(model, ids, window, tile):
                for rows in range(0, len(targets), SCORE_ROWS):
                    logp = torch.log_softmax(logits[rows : rows + SCORE_ROWS].double(), dim=-1)
                    nll_sum += _nll(logp, targets[rows : rows + SCORE_ROWS])
                bar.update(len(targets))
    tokens = len(ids) - 1
    return PerplexityResult(nll_sum, tokens, math.exp(nll_sum / tokens), len(plan))


def kl_divergence(model_ref: LogitModel, model: LogitModel, ids: Sequence[int] | torch.Tensor, context: int = 512,
                  stride: int = 256, progress: bool = True, *, tile: int = TILE) -> KLResult:
    """KL(P_ref || P_model) per scored position over the same windows as `perplexity`, its mean, p99 and max,
    the top-1 agreement and both perplexities. Raises EvalError as `perplexity`, or when the two models'
    vocabularies differ."""
    ids = _as_ids(ids)
    plan = _plan(len(ids), context, stride)
    per_position: list[torch.Tensor] = []
    agree, nll_ref, nll = 0, 0.0, 0.0
    with torch.inference_mode(), _bar(len(ids) - 1, "KL divergence", progress) as bar:
        for window in plan:
            pairs = zip(_window_logits(model_ref, ids, window, tile), _window_logits(model, ids, window, tile),
                        strict=True)
            for (targets, ref_logits), (_, logits) in pairs:
                if logits.shape != ref_logits.shape:
                    raise EvalError(f"the models' vocabularies differ: {ref_logits.shape[-1]} vs {logits.shape[-1]} "
                                    "logits; KL needs the same token ids for both")
                logits = logits.to(ref_logits.device)
                agree += int((ref_logits.argmax(-1) == logits.argmax(-1)).sum())
                for rows in range(0, len(targets), SCORE_ROWS):
                    part = slice(rows, rows + SCORE_ROWS)
                    ref_logp = torch.log_softmax(ref_logits[part].double(), dim=-1)
                    logp = torch.log_softmax(logits[part].double(), dim=-1)
                    p_ref = ref_logp.exp()
                    terms = torch.where(p_ref > 0, p_ref * (ref_logp - logp), 0.0)  # 0 log 0 = 0
                    per_position.append(terms.sum(-1).clamp_min(0.0).cpu())  # negatives are rounding
                    nll_ref += _nll(ref_logp, targets[part])
                    nll += _nll(logp, targets[part])
                bar.update(len(targets))
    kl = torch.cat(per_position).numpy()
    tokens = len(ids) - 1
    return KLResult(mean=float(kl.mean()), p99=float(np.percentile(kl, 99)), max=float(kl.max()), tokens=tokens,
                    top1_agreement=agree / tokens, ref_ppl=math.exp(nll_ref / tokens), ppl=math.exp(nll / tokens))


def unigram_perplexity(train_ids: Sequence[int], test_ids: Sequence[int], vocab_size: int) -> float:
    """Perplexity on `test_ids` of the add-one (Laplace) unigram model of `train_ids`:
    p(v) = (count_train(v) + 1) / (len(train_ids) + vocab_size). The scale a language model must beat."""
    train = np.asarray(train_ids, dtype=np.int64)
    test = np.asarray(test_ids, dtype=np.int64)
    if len(test) == 0:
        raise EvalError("unigram perplexity needs at least one test id")
    for name, values in (("train", train), ("test", test)):
        if len(values) and (values.min() < 0 or values.max() >= vocab_size):
            raise EvalError(f"{name} ids must lie in [0, {vocab_size})")
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64)
    log_p = np.log(counts + 1.0) - math.log(len(train) + vocab_size)
    return math.exp(-float(log_p[test].sum()) / len(test))


# -- the pieces ----------------------------------------------------------------------------------------------


def _as_ids(ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    ids = torch.as_tensor(ids, dtype=torch.long).cpu()
    if ids.dim() != 1:
        raise EvalError(f"token ids must be 1-D, got shape {tuple(ids.shape)}")
    if len(ids) and int(ids.min()) < 0:
        raise EvalError("token ids must be non-negative")
    return ids


def _plan(n_tokens: int, context: int, stride: int) -> list[Window]:
    plan = windows(n_tokens, context, stride)
    if not plan:
        raise EvalError(f"the text has {n_tokens} token(s); scoring needs at least 2")
    return plan


def _window_logits(model: LogitModel, ids: torch.Tensor, window: Window,
                   tile: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(targets [n] on the CPU, their fp32 logits [n, V]) for the window's scored positions: forwards
    ids[begin:end] from a fresh state in calls of at most `tile` tokens (one call when the window fits), the
    calls that hold no scored position without the head."""
    begin, end, score_from = window
    state = model.new_state(end - begin)
    try:
        for start in range(begin, end, tile):
            stop = min(start + tile, end)
            if stop < score_from:  # logits at inputs [start, stop) predict only unscored positions
                model.prefill(ids[start:stop].to(model.device), state)
                continue
            logits = model.prefill(ids[start:stop].to(model.device), state, all_logits=True)
            first = max(start, score_from - 1)  # the input whose logits predict the first scored target here
            targets = ids[first + 1 : min(stop + 1, end)]  # the last input predicts beyond the window
            if len(targets) == 0:
                continue
            logits = logits[first - start : first - start + len(targets)]
            if int(targets.max()) >= logits.shape[-1]:
                raise EvalError(f"token id {int(targets.max())} is outside the model's vocabulary of "
                                f"{logits.shape[-1]}")
            yield targets, logits
    finally:
        model.free_state(state)


def _nll(logp: torch.Tensor, targets: torch.Tensor) -> float:
    """Sum of -logp[i, targets[i]] (float64)."""
    return -float(logp.gather(-1, targets.to(logp.device)[:, None]).sum())


def _bar(total: int, what: str, progress: bool) -> tqdm:
    return tqdm(total=total, unit="tok", unit_scale=True, desc=what, disable=None if progress else True,
                file=sys.stderr, leave=False)


# -- `ninfer ppl` and `ninfer kl` ----------------------------------------------------------------------------


def read_text(path: Path) -> str:
    """The UTF-8 text of `path`, decompressed when its name ends in `.xz`; EvalError naming the file otherwise."""
    try:
        if path.name.endswith(".xz"):
            with lzma.open(path) as f:
                data = f.read()
        else:
            data = path.read_bytes()
    except FileNotFoundError:
        raise EvalError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise EvalError(f"{path}: is a directory, not a text file") from None
    except lzma.LZMAError as exc:
        raise EvalError(f"{path}: not a valid xz file ({exc})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise EvalError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def ppl_command(args: argparse.Namespace) -> int:
    ids = _text_ids(args, [args.model])
    started = time.perf_counter()
    model = _load_model(args.model, args)
    loaded = time.perf_counter()
    result = perplexity(model, ids, args.context, args.stride)
    _stats_line(loaded - started, result.tokens, time.perf_counter() - loaded, model)
    report = {"model": str(args.model), "text": str(args.text), "context": args.context, "stride": args.stride,
              **asdict(result), "nll_mean": result.nll_sum / result.tokens}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"text        {args.text}: {len(ids):,d} tokens")
    print(f"windows     {result.windows:,d} (context {args.context}, stride {args.stride})")
    print(f"scored      {result.tokens:,d} positions, mean NLL {report['nll_mean']:.6f} nats")
    print(f"perplexity  {result.ppl:.6g}")
    return 0


def kl_command(args: argparse.Namespace) -> int:
    ids = _text_ids(args, [args.reference, args.model])
    started = time.perf_counter()
    model_ref, model = _load_model(args.reference, args), _load_model(args.model, args)
    loaded = time.perf_counter()
    result = kl_divergence(model_ref, model, ids, args.context, args.stride)
    _stats_line(loaded - started, result.tokens, time.perf_counter() - loaded, model)
    count = len(windows(len(ids), args.context, args.stride))
    report = {"reference": str(args.reference), "model": str(args.model), "text": str(args.text),
              "context": args.context, "stride": args.stride, "windows": count, **asdict(result)}
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    change = 100.0 * (result.ppl / result.ref_ppl - 1.0)
    print(f"text             {args.text}: {len(ids):,d} tokens")
    print(f"windows          {count:,d} (context {args.context}, stride {args.stride})")
    print(f"scored           {result.tokens:,d} positions")
    print(f"KL mean          {result.mean:.6g} nats")
    print(f"KL p99           {result.p99:.6g} nats")
    print(f"KL max           {result.max:.6g} nats")
    print(f"top-1 agreement  {100.0 * result.top1_agreement:.2f} %")
    print(f"perplexity       reference {result.ref_ppl:.6g}, model {result.ppl:.6g} ({change:+.3f} %)")
    return 0


def _text_ids(args: argparse.Namespace, artifacts: list[Path]) -> list[int]:
    """The text's ids under the first artifact's tokenizer, truncated to --max-tokens; refuses artifacts whose
    tokenizer.json bytes differ from the first's. Checks everything cheap before any weights load."""
    from ninfer.artifact import open_artifact
    from ninfer.frontend import Tokenizer

    windows(0, args.context, args.stride)  # validates the sizes
    text = read_text(args.text)
    with open_artifact(artifacts[0]) as artifact:
        tokenizer = Tokenizer.from_artifact(artifact)
        tokenizer_json = artifact.component_resource("text", "tokenizer.json")
    for path in artifacts[1:]:
        with open_artifact(path) as artifact:
            if artifact.component_resource("text", "tokenizer.json") != tokenizer_json:
                raise EvalError(f"{artifacts[0]} and {path} have different tokenizers (tokenizer.json differs); "
                                "KL divergence needs both models to read the same token ids")
    ids = tokenizer.encode(text, special=False)  # a corpus is plain text: no control tokens from its characters
    return ids[: args.max_tokens] if args.max_tokens else ids


def _load_model(path: Path, args: argparse.Namespace) -> Any:
    from ninfer.artifact import open_artifact
    from ninfer.config import RuntimeConfig
    from ninfer.devices import parse_device
    from ninfer.model.qwen3_5 import Qwen35Model

    device = parse_device(args.device)
    dtype = RuntimeConfig(dtype=args.dtype).torch_dtype(device)
    with open_artifact(path) as artifact:
        model = Qwen35Model.from_artifact(artifact, device, dtype)
    if args.context > model.config.max_positions:
        raise EvalError(f"context {args.context} exceeds {path}'s {model.config.max_positions} positions")
    return model


def _stats_line(load_seconds: float, positions: int, seconds: float, model: Any) -> None:
    dtype = str(model.dtype).removeprefix("torch.")
    print(f"[load {load_seconds:.2f} s | {positions:,d} positions in {seconds:.2f} s, "
          f"{positions / max(seconds, 1e-9):,.0f} tok/s | {model.device} {dtype}]", file=sys.stderr)
