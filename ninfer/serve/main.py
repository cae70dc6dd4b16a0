"""`ninfer serve`: bind the port, load the artifact, start the engine, then serve HTTP until SIGINT / SIGTERM.

The port is bound before the (slow) model load, so that a port already in use fails at once. On a signal, uvicorn
stops accepting connections and lets running requests finish for up to `SHUTDOWN_GRACE_SECONDS`; then the engine
is closed. Logs go to stderr (`--log-level`): the startup, then one line per request (see `ninfer.serve.app`);
"listening on http://HOST:PORT" names the port actually bound (the one the system picked for `--port 0`) once the
server accepts connections.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from pathlib import Path
from typing import Any

from ninfer.cli_types import (
    existing_file,
    non_negative_int,
    positive_finite_float,
    positive_int,
    tcp_port,
    writable_file,
)
from ninfer.errors import NinferError

SHUTDOWN_GRACE_SECONDS = 10
LOG_LEVELS = ("debug", "info", "warning", "error")
log = logging.getLogger("ninfer.serve")


def model_id_of(path: Path) -> str:
    """The id a served artifact answers to by default: its metadata `name`, else the file name without suffix."""
    from ninfer.artifact.reader import Artifact

    with Artifact.open(path) as artifact:
        name = artifact.directory.metadata.get("name")
    return name if isinstance(name, str) and name.strip() else path.stem


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (IPv4 or IPv6); NinferError when the address is unusable."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        raise NinferError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve_command(args: argparse.Namespace) -> int:
    """Run the server described by the `ninfer serve` flags; returns the exit code."""
    from ninfer.config import from_args
    from ninfer.engine import LLM
    from ninfer.engine.llm import DEFAULT_ARTIFACT
    from ninfer.serve.app import ServeConfig, create_app

    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    path = args.model if args.model is not None else DEFAULT_ARTIFACT
    config = from_args(args)  # the cache's sequence slots follow --max-concurrency
    sock = bind(args.host, args.port)
    try:
        llm = LLM(path, config)
        engine = llm.engine
        config = ServeConfig(model_id=args.model_id or model_id_of(path), model_aliases=tuple(args.model_alias),
                             api_key=args.api_key,
                             default_max_tokens=args.default_max_tokens, cors=args.cors,
                             request_log=args.request_log_jsonl, default_thinking=not args.no_thinking,
                             max_body_bytes=args.max_body_mib << 20)
        app = create_app(engine, config)
        log.info("serving %s as %r (device %s, %s runner, context %d, concurrency %d, kv capacity "
                 "%d tokens, loaded in %.1f s)", path, config.model_id, llm.device,
                 "fast" if llm.fast else "reference", llm.max_context, args.max_concurrency, engine.kv_capacity,
                 llm.load_seconds)
        if llm.fast:
            log.info("memory plan: %s", llm.model.describe_memory())
            log.info("warming up: compiling kernels, capturing decode graphs for up to %d sequences",
                     args.max_concurrency)
            log.info("warmed up in %.1f s", llm.model.warm_up(args.max_concurrency))
        engine.start()
        try:
            _serve_http(app, sock, args.host, level)
        except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled: the normal way to stop a server
            log.info("stopped")
        finally:
            engine.close()
    finally:
        sock.close()
    return 0


def _serve_http(app: Any, sock: socket.socket, host: str, level: int) -> None:
    """Serve `app` with uvicorn on the listening `sock` until a signal; logs "listening on http://HOST:PORT" once
    connections are accepted. uvicorn logs through the root logger, warnings and errors only (no access log: the
    app's guard writes one line per request)."""
    import uvicorn

    bound = sock.getsockname()[1]
    url = f"http://[{host}]:{bound}" if ":" in host else f"http://{host}:{bound}"

    class Server(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                log.info("listening on %s", url)

    config = uvicorn.Config(app, host=host, port=bound, log_config=None, log_level=max(level, logging.WARNING),
                            access_log=False, lifespan="on", timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS)
    Server(config).run(sockets=[sock])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `ninfer serve` flags."""

    def kv_capacity_arg(text: str) -> int | str:  # a positive token count or "auto"
        return text if text == "auto" else positive_int(text)

    parser.add_argument("model", nargs="?", type=existing_file,
                        help="a .ninfer artifact (default: the embedded demo model)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument("--port", type=tcp_port, default=8080,
                        help="port to listen on, 0 to 65535; 0 picks a free one, which the 'listening on' log line "
                             "names (default %(default)s)")
    parser.add_argument("--model-id", help="the id clients send as `model`, listed by /v1/models (default: the "
                                           "artifact's name)")
    parser.add_argument("--model-alias", action="append", default=[], metavar="NAME",
                        help="another name a request's `model` may give, answered like the model id (repeatable; e.g. "
                             "the Claude or GPT model a client is set to ask for); any other name gets 404")
    parser.add_argument("--api-key", help="require this key (Authorization: Bearer KEY or x-api-key: KEY)")
    parser.add_argument("--max-concurrency", type=positive_int, default=8,
                        help="sequences decoded together (default %(default)s)")
    parser.add_argument("--max-context", type=positive_int, help="context length (default: the model's)")
    parser.add_argument("--kv-capacity", type=kv_capacity_arg,
                        help="context tokens over all running sequences, or 'auto' (the default: on CUDA what the "
                             "free device memory holds, at most max-concurrency x max-context; on the reference "
                             "runner max-concurrency x max-context)")
    parser.add_argument("--interleaved-prefill-chunk", type=positive_int, default=512,
                        help="prompt tokens a request prefills per engine step while other streams decode, so that "
                             "they go on between its pieces (default %(default)s)")
    parser.add_argument("--max-pending", type=non_negative_int, default=64,
                        help="requests that may wait for a slot; more get 429 (default %(default)s)")
    parser.add_argument("--queue-timeout", type=positive_finite_float, default=60.0,
                        help="seconds a request may wait for a slot before a 503 (default %(default)s)")
    parser.add_argument("--default-max-tokens", type=positive_int, default=1024,
                        help="output budget of requests that set none (default %(default)s)")
    parser.add_argument("--max-body-mib", type=positive_int, default=8,
                        help="largest request body in MiB; larger gets 413 (default %(default)s)")
    parser.add_argument("--no-thinking", action="store_true", help="thinking off for requests that do not say")
    parser.add_argument("--cors", action="store_true", help="allow browser clients from any origin")
    parser.add_argument("--request-log-jsonl", type=writable_file, metavar="FILE",
                        help="append one JSON line per request (ids, tokens, timings; never text)")
    parser.add_argument("--log-level", choices=LOG_LEVELS, default="info",
                        help="stderr log detail; info logs one line per request (default %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                        help="compute dtype (default auto: fp32 on the CPU, bf16 on CUDA)")
