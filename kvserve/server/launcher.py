"""``kvserve serve``: flags, start-up, signals and the exit status.

The port is bound before the weights load (probes get 503 "loading" rather
than a refused connection); a port that cannot be bound (in use,
privileged) fails before anything loads, in one line with exit 1; a bad ``--model`` still
fails at once, because the engine configuration is resolved before uvicorn
starts (so is each ``--lora-modules`` adapter's config; its tensors load
with the model).
With ``--node-rank N`` (N > 0) of a multi-node parallel engine it
serves nothing and runs that node's worker processes until node 0 stops.
SIGTERM (or Ctrl-C) drains: ``/ready`` and new requests get 503 while
in-flight requests run for up to ``--shutdown-timeout`` seconds; the rest are
aborted with ``finish_reason: "abort"``, then the process exits 0. A second
signal aborts them at once (then exits 0 the same way), a third ends the
process on the spot. When the engine dies (a forward raised, or one ran
past ``--engine-watchdog-s``) the process exits 1, without waiting for a
hung engine thread. ``--engine-core process`` (the default on CUDA) runs
the engine core in its own process (``engine/core_proc.py``); its death
fails the requests in flight and exits 1 the same way. ``kvserve serve
MODEL`` is ``--model MODEL``. With ``--data-parallel-size N`` it starts N
such servers as children behind a ``kvserve router`` (``kvserve/router/data_parallel.py``).
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve import envs
from kvserve.net import check_port_free
from kvserve.server.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from kvserve.lora.request import LoRARequest

logger = logging.getLogger("kvserve.server")

DEFAULT_PORT = 8000
DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_MAX_REQUEST_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_MAX_N = 128
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
DEFAULT_ENGINE_WATCHDOG_S = 300.0
DEFAULT_HEALTH_STALL_S = 30.0


def add_serve_parser(sub: Any) -> None:
    """Mount ``serve`` on the ``kvserve`` subcommand parser."""
    from kvserve.engine.args import EngineArgs

    parser = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server",
        description="Serve a model over the OpenAI API (/v1/completions, "
                    "/v1/chat/completions, /v1/models) plus /health, /ready, /metrics, "
                    "/tokenize, /detokenize and /version.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model, as with --model (vLLM's positional spelling)")
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1",
                       help="interface to bind (default 127.0.0.1; 0.0.0.0 for all)")
    group.add_argument("--port", type=int, default=DEFAULT_PORT,
                       help="port to listen on (default: %(default)s)")
    group.add_argument("--api-key", nargs="+", action="extend", default=None,
                       help="accepted API key(s); default $KVSERVE_API_KEY (comma-separated)."
                            " Only /health, /ready and /metrics stay open")
    group.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use for the model (the first is reported)")
    group.add_argument("--lora-modules", nargs="+", action="extend", default=None,
                       metavar="NAME=PATH",
                       help="PEFT LoRA adapters to serve (needs --enable-lora); a request "
                            "selects one by sending its NAME as 'model'")
    group.add_argument("--allow-runtime-lora-updating", action="store_true",
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
                            "(needs --enable-lora; behind the API key)")
    group.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS,
                       help="sequences allowed to wait beyond --max-num-seqs; above it, 503")
    group.add_argument("--max-request-body-bytes", type=int,
                       default=DEFAULT_MAX_REQUEST_BODY_BYTES, help="larger bodies get 413")
    group.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="the cap on n")
    group.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="the model's tool-call format, for tool_choice 'auto'")
    group.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                       help="seconds to drain on SIGTERM before aborting what is left")
    group.add_argument("--engine-watchdog-s", type=float, default=DEFAULT_ENGINE_WATCHDOG_S,
                       help="a step running longer kills the server (exit 1); 0 = off")
    group.add_argument("--engine-core", choices=("auto", "process", "inproc"), default="auto",
                       help="where the engine core (scheduler + model) runs: its own process "
                            "(the HTTP front end then keeps the GIL for tokenizing, "
                            "detokenizing and streaming) or this one; auto: its own process "
                            "on CUDA, this one on CPU (default: %(default)s)")
    group.add_argument("--health-stall-s", type=float, default=DEFAULT_HEALTH_STALL_S,
                       help="/health and /ready turn 503 when the engine loop has not "
                            "progressed for this long")
    group.add_argument("--timeout-keep-alive", type=float, default=5.0,
                       help="seconds an idle HTTP connection stays open (default: %(default)s)")
    group.add_argument("--uvicorn-log-level", default="info",
                       choices=("critical", "error", "warning", "info", "debug", "trace"),
                       help="uvicorn's log level; info logs one line per HTTP request "
                            "(default: %(default)s)")
    group.add_argument("--disable-access-log", action="store_true",
                       help="no uvicorn line per HTTP request")
    group.add_argument("--enable-log-requests", action="store_true", dest="log_requests",
                       help="log each request's prompt length and sampling parameters")
    group.add_argument("--disable-log-requests", action="store_false", dest="log_requests",
                       default=False, help="do not log each request (the default; vLLM's spelling)")
    _add_data_parallel_args(parser)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run_serve)


def _add_data_parallel_args(parser: argparse.ArgumentParser) -> None:
    from kvserve.router.launcher import add_router_options

    group = parser.add_argument_group("data parallelism")
    group.add_argument("--data-parallel-size", type=int, default=1,
                       help="N > 1: N engine servers (one per GPU, or per tensor x pipeline "
                            "group of GPUs) behind one kvserve router on --host / --port")
    group.add_argument("--router-startup-timeout-s", type=float, default=600.0,
                       help="with --data-parallel-size: seconds to wait for the engines to "
                            "load (default: %(default)s)")
    add_router_options(parser, prefix="router-")


def _check_args(args: argparse.Namespace) -> None:
    positive = {"--max-request-body-bytes": args.max_request_body_bytes,
                "--max-n": args.max_n, "--health-stall-s": args.health_stall_s}
    for flag, value in positive.items():
        if not value > 0:
            raise ValueError(f"{flag}={value} is invalid: must be > 0")
    non_negative = {"--max-queued-requests": args.max_queued_requests,
                    "--shutdown-timeout": args.shutdown_timeout,
                    "--engine-watchdog-s": args.engine_watchdog_s}
    for flag, value in non_negative.items():
        if not value >= 0:
            raise ValueError(f"{flag}={value} is invalid: must be >= 0")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port={args.port} is invalid: must be in [0, 65535]")


def _take_model_tag(args: argparse.Namespace) -> None:
    """``kvserve serve MODEL`` is ``--model MODEL``; giving two different models is an error."""
    if args.model_tag is None:
        return
    if args.model is not None and args.model != args.model_tag:
        raise ValueError(f"the model is given twice: '{args.model_tag}' and --model "
                         f"'{args.model}'; give it once")
    args.model = args.model_tag


def parse_lora_modules(args: argparse.Namespace, served_names: list[str]) -> list[LoRARequest]:
    """``--lora-modules NAME=PATH ...`` as LoRARequests with ids 1, 2, ..., each
    adapter's ``adapter_config.json`` checked now (before the port is bound)."""
    from kvserve.lora.peft import read_adapter_config
    from kvserve.lora.request import LoRARequest

    specs: list[str] = args.lora_modules or []
    if specs and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    if args.allow_runtime_lora_updating and not args.enable_lora:
        raise ValueError("--allow-runtime-lora-updating needs --enable-lora")
    taken = set(served_names)
    requests: list[LoRARequest] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not (sep and name and path):
            raise ValueError(f"--lora-modules: '{spec}' is invalid: write NAME=PATH")
        if name in taken:
            raise ValueError(f"--lora-modules: the name '{name}' is already used by the model "
                             "or another adapter")
        taken.add(name)
        try:
            read_adapter_config(Path(path), args.max_lora_rank)
        except ValueError as e:
            raise ValueError(f"--lora-modules {name}: {e}") from e
        requests.append(LoRARequest(name, len(requests) + 1, str(Path(path).resolve())))
    return requests


def run_serve(args: argparse.Namespace) -> int:
    """Run the server until it is told to stop; the process exit status."""
    import uvicorn

    from kvserve.assets import DEFAULT_MODEL
    from kvserve.engine.args import EngineArgs
    from kvserve.engine.generation_config import describe
    from kvserve.server.api import build_app
    from kvserve.server.state import DrainingServer, ServerConfig, ServerState

    _check_args(args)
    _take_model_tag(args)
    engine_args = EngineArgs.from_cli_args(args)
    engine_config = engine_args.create_engine_config()  # a bad --model fails here, exit 2
    if engine_config.parallel_config.node_rank == 0:  # a worker node listens on nothing
        check_port_free(args.host, args.port)
    if args.data_parallel_size != 1:
        from kvserve.router.data_parallel import run_data_parallel

        if args.data_parallel_size < 1 or engine_config.parallel_config.nnodes > 1:
            raise ValueError(f"--data-parallel-size={args.data_parallel_size} is invalid: "
                             "must be >= 1, on one node")
        if engine_config.kv_transfer_config.disaggregated:
            raise ValueError("--kv-role prefill / decode is for one engine per server: start "
                             "each with its own --kv-transfer-port and put kvserve router "
                             "--prefill ... --decode ... in front")
        return run_data_parallel(args, getattr(args, "argv", sys.argv[1:]), engine_config)
    if engine_config.parallel_config.node_rank > 0:  # a worker node of a multi-node engine
        from kvserve.engine.engine_core import run_worker_node

        return run_worker_node(engine_config)
    faults = envs.fault_injection()
    watchdog_s = args.engine_watchdog_s or None
    served_names = args.served_model_name or [args.model or DEFAULT_MODEL]
    config = ServerConfig(
        served_model_names=served_names,
        lora_requests=parse_lora_modules(args, served_names),
        api_keys=args.api_key or envs.kvserve_api_keys(),
        max_num_seqs=engine_config.scheduler_config.max_num_seqs,
        max_queued_requests=args.max_queued_requests,
        max_request_body_bytes=args.max_request_body_bytes,
        max_n=args.max_n, health_stall_s=args.health_stall_s,
        shutdown_timeout_s=args.shutdown_timeout, tool_call_parser=args.tool_call_parser,
        allow_runtime_lora_updating=args.allow_runtime_lora_updating,
    )

    core_process = (args.engine_core == "process"
                    or (args.engine_core == "auto" and engine_config.device.startswith("cuda")))

    def load() -> Any:
        from kvserve.engine.client import ThreadedEngineClient
        from kvserve.engine.engine_core import EngineCore, create_executor, freeze_startup_heap
        from kvserve.engine.llm_engine import LLMEngine, load_engine_tokenizer
        from kvserve.server.faults import inject_faults

        if core_process:
            from kvserve.engine.core_proc import MPCoreClient

            setup = functools.partial(inject_faults, faults=faults) if faults.enabled else None
            core: Any = MPCoreClient(engine_config, setup, config.lora_requests, watchdog_s)
            # the core process watches its own steps
            engine = LLMEngine(engine_config, load_engine_tokenizer(engine_config), core)
            client = ThreadedEngineClient(engine, log_requests=args.log_requests)
        else:
            core = EngineCore(engine_config, create_executor(engine_config))
            engine = LLMEngine(engine_config, load_engine_tokenizer(engine_config), core)
            for lora_request in config.lora_requests:
                engine.add_lora(lora_request)
            inject_faults(core.executor, faults)
            client = ThreadedEngineClient(engine, watchdog_s=watchdog_s,
                                          log_requests=args.log_requests)
        freeze_startup_heap()
        return client

    logging.getLogger("kvserve").setLevel(
        min(logging.getLogger("kvserve").getEffectiveLevel(), logging.INFO))
    state = ServerState(config, loader=load)
    server = DrainingServer(uvicorn.Config(
        build_app(state), host=args.host, port=args.port, log_level=args.uvicorn_log_level,
        access_log=not args.disable_access_log, timeout_keep_alive=int(args.timeout_keep_alive),
        timeout_graceful_shutdown=5, lifespan="on",
    ), state)
    state.request_exit = server.request_exit
    logger.info("kvserve serve: %s on http://%s:%d (model %s)", config.model_name, args.host,
                args.port, engine_config.model)
    if engine_config.sampling_defaults:
        logger.info("default sampling parameters from the model's generation config: %s "
                    "(a request's own values win; --generation-config vllm ignores them)",
                    describe(engine_config.sampling_defaults))
    server.run()
    if state.exit_code:
        # the engine thread may be stuck in a forward that never returns; the
        # core process and worker processes are killed, not waited for
        if state.client is not None:
            state.client.kill()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(state.exit_code)
    return 0
