"""Concurrent streaming chat clients against `ninfer serve` (in-process uvicorn on loopback): aggregate decode
tok/s and time to first token for 1, 2, 4 and 8 clients, and TTFT with a cold vs a warm shared prefix.

    python scripts/serve_concurrency.py [MODEL.ninfer] [--device cuda] [--tokens 128] [--prefix-tokens 2048]
                                        [--kv-dtype bf16|int8|fp8]

Each client sends a distinct prompt, greedy, `ignore_eos`, `max_tokens` = --tokens. Decode tok/s = all
generated tokens / wall time from the first request to the last answer (prefill included, as a user sees it).
The fast runner is warmed up first (`FastQwen35.warm_up`, as `ninfer serve` does), then one unmeasured round per
client count.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from ninfer.engine import LLM
from ninfer.serve.app import ServeConfig, create_app


def start_server(app) -> tuple[uvicorn.Server, str]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.01)
    return server, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def one_client(client: httpx.AsyncClient, url: str, model: str, messages: list, tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "enable_thinking": False}
    started = time.perf_counter()
    first = None
    usage = {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices") and (chunk["choices"][0]["delta"].get("content")
                                                            or chunk["choices"][0]["delta"].get("reasoning_content")):
                first = time.perf_counter() - started
            if chunk.get("usage"):
                usage = chunk["usage"]
    return {"ttft": first, "seconds": time.perf_counter() - started, "tokens": usage.get("completion_tokens", 0),
            "cached": usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)}


async def round_of(url: str, model: str, clients: int, tokens: int, system: str) -> dict:
    async with httpx.AsyncClient() as client:
        started = time.perf_counter()
        results = await asyncio.gather(*(one_client(client, url, model, [
            {"role": "system", "content": system},
            {"role": "user", "content": f"Client {i}: write a Python function number {i}."}], tokens)
            for i in range(clients)))
        wall = time.perf_counter() - started
    return {"clients": clients, "aggregate_tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_median_s": statistics.median(r["ttft"] for r in results), "wall_s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prefix-tokens", type=int, default=2048, help="length of the shared system prompt")
    parser.add_argument("--kv-dtype", default="bf16", choices=["bf16", "int8", "fp8"])
    args = parser.parse_args()
    llm = LLM(args.model, device=args.device, max_concurrency=8, kv_dtype=args.kv_dtype)  # as `ninfer serve` loads it
    if llm.fast:  # as `ninfer serve` does before it listens
        print(f"warmed up in {llm.model.warm_up(8):.1f} s")
    engine = llm.engine.start()
    model_id = "bench"
    log_path = Path(tempfile.mkdtemp()) / "requests.jsonl"  # the server's request log: per-request phase timings
    server, url = start_server(create_app(engine, ServeConfig(model_id=model_id, request_log=log_path)))

    def measured(clients: int, tokens: int, system: str) -> dict:
        """A round, with the engine's median queue / prefill / decode seconds of its requests (request log)."""
        done = len(log_path.read_text().splitlines())
        row = asyncio.run(round_of(url, model_id, clients, tokens, system))
        deadline = time.perf_counter() + 5  # the server writes a request's line after its response has ended
        while len(log_path.read_text().splitlines()) < done + clients and time.perf_counter() < deadline:
            time.sleep(0.01)
        records = [json.loads(line) for line in log_path.read_text().splitlines()[done:]]
        for phase in ("queue", "prefill", "decode"):
            row[phase] = statistics.median(r[f"{phase}_seconds"] or 0.0 for r in records) if records else float("nan")
        return row

    try:
        for clients in (1, 2, 4, 8):  # the sampling and output path's first calls, at every batch size
            asyncio.run(round_of(url, model_id, clients, 8, "Warm up."))
        rows = [measured(n, args.tokens, f"Session {n}. Be brief.") for n in (1, 2, 4, 8)]
        words = " ".join(f"word{i}" for i in range(args.prefix_tokens))  # ~2 tokens a word with small vocabularies
        system = llm.tokenizer.decode(llm.tokenizer.encode(words)[: args.prefix_tokens])
        cold = measured(1, 8, system)
        warm = measured(1, 8, system)
    finally:
        server.should_exit = True
        engine.close()
    print(f"model {llm.path.name} on {llm.device} ({llm.dtype}, {'fast' if llm.fast else 'reference'} runner, "
          f"{args.kv_dtype} KV), {args.tokens} tokens per client")
    print("clients  aggregate tok/s  median TTFT s  wall s  | engine medians: queue s  prefill s  decode s")
    for row in rows:
        print(f"{row['clients']:>7}  {row['aggregate_tok_s']:>15.1f}  {row['ttft_median_s']:>13.3f}  "
              f"{row['wall_s']:>6.2f}  | {row['queue']:>22.3f}  {row['prefill']:>9.3f}  {row['decode']:>8.3f}")
    for name, row in (("cold", cold), ("warm", warm)):
        print(f"shared {args.prefix_tokens}-token prefix, {name}: TTFT {row['ttft_median_s']:.3f} s (engine: queue "
              f"{row['queue']:.3f} s, prefill {row['prefill']:.3f} s)")


if __name__ == "__main__":
    main()
