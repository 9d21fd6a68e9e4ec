"""The `nanovllm` command (also `python -m nanovllm`); each `LLM(...)` option is a flag (entrypoints/args.py):

    nanovllm serve MODEL [options]   an OpenAI-compatible server (needs the `serve` extra)
    nanovllm chat MODEL [options]    an interactive chat in the terminal
"""
import argparse
import os
import signal
import sys

from nanovllm.distributed.router import ROUTINGS
from nanovllm.entrypoints.args import add_llm_arguments
from nanovllm.entrypoints.chat import chat
from nanovllm.entrypoints.reasoning_parsers import REASONING_PARSERS
from nanovllm.entrypoints.tool_parsers import TOOL_PARSERS
from nanovllm.utils.logging import configure_logging

LOG_LEVELS = ["critical", "error", "warning", "info", "debug"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nanovllm", description="nanovllm: serve or chat with a model.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve_parser = commands.add_parser("serve", help="an OpenAI-compatible HTTP server",
                                       description="Serve MODEL over the OpenAI API (completions, chat completions).")
    serve_parser.add_argument("model", help="a Hugging Face model folder")
    serve_parser.add_argument("--host", default="127.0.0.1")
    serve_parser.add_argument("--port", type=int, default=8000)
    serve_parser.add_argument("--api-key", default=os.environ.get("NANOVLLM_API_KEY"),
                              help="require `Authorization: Bearer KEY` on /v1/* (default: $NANOVLLM_API_KEY)")
    serve_parser.add_argument("--served-model-name", help="the model's name in the API (default: MODEL as given)")
    serve_parser.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default="hermes",
                              help="how the model writes tool calls (hermes: <tool_call>{...}</tool_call>, "
                                   "Qwen2.5's and Qwen3's)")
    serve_parser.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                              help="return the model's reasoning (qwen3: a <think>...</think> block) as "
                                   "reasoning_content")
    serve_parser.add_argument("--max-queued-requests", type=int, default=None,
                              help="refuse requests with 503 while this many are waiting (default: no limit)")
    serve_parser.add_argument("--max-request-bytes", type=int, default=8 * 2**20,
                              help="refuse a larger body with 413, before parsing it (default: 8 MiB, room "
                                   "for a 128k-token context as JSON token ids)")
    serve_parser.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                              help="fetch image_url parts over http(s) from these hosts (and hosts under them); "
                                   "default: none, data URLs only")
    serve_parser.add_argument("--max-image-bytes", type=int, default=5 * 2**20,
                              help="refuse a larger image (fetched or in a data URL) with 400 (default: 5 MiB)")
    serve_parser.add_argument("--image-fetch-timeout", type=float, default=5.0, metavar="SECONDS",
                              help="the most one image's fetch may take (default: 5 s)")
    serve_parser.add_argument("--no-metrics", action="store_true", help="no Prometheus /metrics endpoint")
    serve_parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                              help="the level of nanovllm's log (on stderr) and of uvicorn's")
    serve_parser.add_argument("--disable-log-requests", action="store_true",
                              help="no access-log line per HTTP request (uvicorn's access log)")
    serve_parser.add_argument("--data-parallel-size", type=int, default=1, metavar="N",
                              help="N replicas of the whole engine, each a process on its own "
                                   "tensor_parallel_size x pipeline_parallel_size GPUs, behind this server")
    serve_parser.add_argument("--data-parallel-routing", choices=ROUTINGS, default="prefix",
                              help="which replica runs a prompt: prefix (where its leading blocks went before, "
                                   "unless that replica is a batch busier than the least busy) or round_robin")
    serve_parser.add_argument("--headless", action="store_true",
                              help="one of the other nodes of a multi-node engine (--nnodes, --node-rank >= 1, "
                                   "--master-addr, --master-port): run this node's ranks only, serve nothing")
    add_llm_arguments(serve_parser)

    chat_parser = commands.add_parser("chat", help="an interactive chat in the terminal",
                                      description="Chat with MODEL: replies stream as they are generated; the "
                                                  "conversation's prefix is served from the KV cache. "
                                                  "/reset starts over, /exit or Ctrl-D leaves.")
    chat_parser.add_argument("model", help="a Hugging Face model folder whose tokenizer has a chat template")
    chat_parser.add_argument("--system", default=None, help="a system message to start the conversation with")
    chat_parser.add_argument("--temperature", type=float, default=0.7)
    chat_parser.add_argument("--top-p", type=float, default=1.0)
    chat_parser.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply")
    chat_parser.add_argument("--seed", type=int, default=None)
    chat_parser.add_argument("--log-level", default="info", choices=LOG_LEVELS,
                             help="the level of nanovllm's log, on stderr (the chat is on stdout)")
    add_llm_arguments(chat_parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.log_level)
    try:
        return run(args)
    except (ValueError, TypeError) as e:  # a bad option (the engine's and SamplingParams' errors say which)
        print(f"nanovllm {args.command}: error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    if args.command == "serve" and args.headless:
        from nanovllm.distributed.nodes import run_headless
        from nanovllm.entrypoints.args import config_from_args
        return run_headless(config_from_args(args))
    if args.command == "serve":
        if args.max_queued_requests is not None and args.max_queued_requests < 1:
            raise SystemExit(f"nanovllm serve: --max-queued-requests must be >= 1, got {args.max_queued_requests}")
        if args.data_parallel_size < 1:
            raise SystemExit(f"nanovllm serve: --data-parallel-size must be >= 1, got {args.data_parallel_size}")
        if args.data_parallel_size > 1 and args.nnodes > 1:
            raise SystemExit("nanovllm serve: --data-parallel-size > 1 runs on one node; --nnodes > 1 is for "
                             "tensor or pipeline parallelism over nodes")
        if args.max_image_bytes < 1 or args.image_fetch_timeout <= 0:
            raise SystemExit("nanovllm serve: --max-image-bytes must be >= 1 and --image-fetch-timeout > 0")
        if args.max_request_bytes < 1:
            raise SystemExit(f"nanovllm serve: --max-request-bytes must be >= 1, got {args.max_request_bytes}")
        try:  # imported here, not at the top: the server needs the optional `serve` extra (FastAPI, uvicorn)
            from nanovllm.entrypoints.api_server import serve
        except ImportError as e:
            raise SystemExit(f"nanovllm serve needs the serve extra ({e.name} is missing): "
                             "pip install 'nanovllm[serve]'") from e
        return serve(args)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    return chat(args)


if __name__ == "__main__":
    sys.exit(main())
