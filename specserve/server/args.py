"""`specserve serve`'s server flags (imported by `--help`: no torch, no FastAPI here)."""

from __future__ import annotations

import argparse

# Longer than the idle expiry of common HTTP client pools (httpx and the openai client: 5 s). With equal
# timeouts the server may close an idle connection just as the client reuses it: connection reset.
DEFAULT_KEEP_ALIVE_S = 30
DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # 4 MiB: ~1M tokens of text, far past any context length served


def add_serve_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer <key>` on /v1/* (default: $SPECSERVE_API_KEY if set, "
                        "else no key)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model id(s) clients may send (default: the engine's model name; 'default' always works)")
    g.add_argument("--api-server-count", type=int, default=1,
                   help="HTTP front-end processes sharing the port (tokenize, detokenize, stream); one engine core")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine-core replicas (each of --tensor-parallel-size GPUs) behind the front-ends; a "
                        "request goes to the least loaded")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="a request body larger than this gets 413 before it is read or tokenized")
    g.add_argument("--stream-interval", type=int, default=1,
                   help="tokens a stream gathers before it sends a chunk; a chunk always carries every token "
                        "gained since the last one")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: seconds requests in flight may run on before they are aborted")
    g.add_argument("--enable-access-log", action="store_true", help="log every HTTP request (off: it costs at load)")
    g.add_argument("--timeout-keep-alive", type=int, default=DEFAULT_KEEP_ALIVE_S,
                   help="seconds an idle HTTP/1.1 connection stays open (keep it longer than clients' pool "
                        "expiry, or a reused connection may be reset)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"], help="uvicorn's log level")
    return parser


def check_serve_args(args: argparse.Namespace) -> None:
    for name, low in (("timeout_keep_alive", 1), ("api_server_count", 1), ("stream_interval", 1),
                      ("shutdown_timeout", 0), ("max_request_bytes", 1), ("data_parallel_size", 1)):
        value = getattr(args, name)
        if value is not None and value < low:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= {low}, got {value}")
