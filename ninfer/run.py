"""`ninfer run`: stream one generation to the terminal.

The answer goes to stdout as it is decided; reasoning, tool-call notices and a stats line (load time,
prompt tokens, prefill and decode speed) go to stderr, so `ninfer run ... > answer.txt` keeps only the answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ninfer.config import from_args
from ninfer.engine import LLM, Finished
from ninfer.errors import NinferError
from ninfer.frontend import ContentDelta, ReasoningDelta, ToolCall, UnsupportedContentError, check_text_only
from ninfer.sampling import SamplingParams

SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "seed")


def _read_messages(path: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise NinferError(f"{path}: no such file") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NinferError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict):
        messages, tools = data.get("messages"), data.get("tools")
    else:
        messages, tools = data, None
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m
                                                                 for m in messages):
        raise NinferError(f"{path}: expected a non-empty list of messages with a 'role' each")
    if tools is not None and not isinstance(tools, list):
        raise NinferError(f"{path}: 'tools' must be a list")
    try:
        check_text_only(messages)
    except UnsupportedContentError as exc:
        raise NinferError(f"{path}: {exc}") from None
    return messages, tools


def run_command(args: argparse.Namespace) -> int:
    overrides = {flag: getattr(args, flag) for flag in SAMPLING_FLAGS if getattr(args, flag) is not None}
    if args.greedy:
        overrides["temperature"] = 0.0
    SamplingParams(max_tokens=args.max_new, stop=tuple(args.stop), **overrides)  # the flags' ranges, before the load
    tools = None
    if args.messages is not None:  # read before the (slow) load, so that a bad file fails at once
        prompt, tools = _read_messages(args.messages)
    elif args.prompt_ids is not None:
        prompt = args.prompt_ids
    else:
        prompt = args.prompt
    llm = LLM(args.model, from_args(args, max_concurrency=1))
    params = llm.default_params(max_tokens=args.max_new, stop=tuple(args.stop), **overrides)
    completion = None
    for event in llm.stream(prompt, params, raw=args.raw, thinking=not args.no_thinking, tools=tools):
        if isinstance(event, ContentDelta):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, ReasoningDelta):
            sys.stderr.write(event.text)
            sys.stderr.flush()
        elif isinstance(event, ToolCall):
            sys.stdout.write(json.dumps({"tool_call": {"name": event.name, "arguments": event.arguments}},
                                        ensure_ascii=False) + "\n")
        elif isinstance(event, Finished):
            completion = event.completion
    assert completion is not None
    sys.stdout.write("\n")
    if args.print_token_ids:
        sys.stdout.write(",".join(map(str, completion.token_ids)) + "\n")
    stats = completion.stats
    print(f"\n[load {llm.load_seconds:.2f} s | prompt {stats.prompt_tokens} tokens | prefill "
          f"{stats.prefill_tokens_per_second:.1f} tok/s | decode {stats.decode_tokens_per_second:.1f} tok/s | "
          f"{stats.generated_tokens} tokens, finish {completion.finish_reason}{_speculation(stats.speculation)} | "
          f"{llm.device}, {'fast' if llm.fast else 'reference'} runner]", file=sys.stderr)
    return 0


def _speculation(spec: Any) -> str:
    """The stats line's part on speculative rounds: rounds, drafts accepted, tokens per round, acceptance per
    draft position."""
    if spec is None or not spec.rounds:
        return ""
    positions = "/".join(f"{a / d:.2f}" for a, d in zip(spec.accepted_per_position, spec.drafted_per_position,
                                                           strict=True))
    return (f" | mtp {spec.rounds} rounds, {spec.accepted}/{spec.drafted} drafts accepted, "
            f"{spec.tokens_per_round:.2f} tokens/round, by position {positions}")
