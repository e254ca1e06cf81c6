"""``kvserve router``: flags, the start-up check of the backends, the exit status.

At start-up every ``--backend`` is probed for up to ``--startup-timeout-s``
seconds: one that never answers is named in a warning, and when none
answers the command fails (exit 1) naming them all in one line, with no
traceback; a port that cannot be bound fails first. SIGTERM or Ctrl-C stops
accepting requests, lets those in flight finish for up to
``--shutdown-timeout`` seconds, then exits 0; a second Ctrl-C exits at once.
``run_router`` is also what ``kvserve serve --data-parallel-size`` runs in
front of its engine processes.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import uvicorn

from kvserve.router import policy as policies
from kvserve.router.backends import (
    DEFAULT_HEALTH_INTERVAL_S,
    DEFAULT_UNHEALTHY_AFTER,
    BackendPool,
    check_backend_url,
)

logger = logging.getLogger("kvserve.router")

DEFAULT_PORT = 8000
DEFAULT_STARTUP_TIMEOUT_S = 10.0
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0
CONNECT_TIMEOUT_S = 5.0


def add_router_options(parser: argparse.ArgumentParser | Any, prefix: str = "") -> None:
    """The routing flags (``prefix`` "router-" when mounted on ``serve``, where
    the block size is the engines' own ``--block-size``)."""
    group = parser.add_argument_group("routing")
    group.add_argument(f"--{prefix}policy", default="prefix", choices=list(policies.POLICIES),
                       help="prefix: same prompt prefix, same backend while its load allows "
                            "(default); least_load: fewest running + waiting requests; "
                            "round_robin: in turn")
    if not prefix:
        group.add_argument("--block-size", type=int, default=policies.DEFAULT_BLOCK_SIZE,
                           help="tokens per hashed prompt block (the engines' --block-size; "
                                "default: %(default)s)")
    group.add_argument(f"--{prefix}balance-threshold", type=float,
                       default=policies.DEFAULT_BALANCE_THRESHOLD,
                       help="prefix policy: go to the least-loaded backend instead when the "
                            "prefix's backend has this many more requests (default: "
                            "%(default)s)")
    group.add_argument(f"--{prefix}prefix-min-match", type=float,
                       default=policies.DEFAULT_MIN_MATCH,
                       help="prefix policy: follow a remembered prefix only when it covers "
                            "this share of the prompt's blocks; shorter matches go to the "
                            "least-loaded backend (default: %(default)s)")
    group.add_argument(f"--{prefix}max-prefix-entries", type=int,
                       default=policies.DEFAULT_MAX_PREFIX_ENTRIES,
                       help="prefix policy: block hashes remembered, least recently used "
                            "dropped first (default: %(default)s)")
    group.add_argument(f"--{prefix}health-interval-s", type=float,
                       default=DEFAULT_HEALTH_INTERVAL_S,
                       help="seconds between probes of each backend's /health and /metrics "
                            "(default: %(default)s)")


def add_router_parser(sub: Any) -> None:
    """Mount ``router`` on the ``kvserve`` subcommand parser."""
    parser = sub.add_parser(
        "router", help="OpenAI-compatible router in front of several servers",
        description="Forward OpenAI requests (streaming included) to backend servers: "
                    "kvserve serve, or any OpenAI-compatible server with round_robin. "
                    "Serves /v1/completions, /v1/chat/completions, /v1/models, /health, "
                    "/ready and its own /metrics.")
    parser.add_argument("--backend", nargs="+", action="extend", default=[],
                        metavar="URL", help="a backend's root URL, http://HOST:PORT "
                                            "(repeatable; each at most once)")
    parser.add_argument("--prefill", nargs="+", action="extend", default=[], metavar="URL",
                        help="disaggregated mode: a prefill engine (kvserve serve --kv-role "
                             "prefill); requests go to one of these first, then to --decode")
    parser.add_argument("--decode", nargs="+", action="extend", default=[], metavar="URL",
                        help="disaggregated mode: a decode engine (kvserve serve --kv-role "
                             "decode), which pulls the prompt's KV and answers the client")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to bind (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT,
                        help="port to listen on (default: %(default)s)")
    parser.add_argument("--tokenizer", default=None,
                        help="directory of the backends' tokenizer, so prefix routing hashes "
                             "token ids as the engines do (default: the prompt's UTF-8 bytes)")
    parser.add_argument("--startup-timeout-s", type=float, default=DEFAULT_STARTUP_TIMEOUT_S,
                        help="seconds to wait for the backends at start-up (default: "
                             "%(default)s)")
    parser.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="seconds in-flight requests may take after SIGTERM (default: "
                             "%(default)s)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"),
                        help="uvicorn's log level (default: %(default)s)")
    parser.add_argument("--disable-access-log", action="store_true",
                        help="no uvicorn line per HTTP request")
    add_router_options(parser)
    parser.set_defaults(func=run_router_command)


@dataclass(frozen=True)
class RouterOptions:
    """What ``run_router`` needs, from either command's flags."""

    backends: list[str]
    host: str
    port: int
    policy: str
    block_size: int
    balance_threshold: float
    prefix_min_match: float
    max_prefix_entries: int
    health_interval_s: float
    startup_timeout_s: float
    shutdown_timeout_s: float
    tokenizer: str | None = None
    uvicorn_log_level: str = "info"
    access_log: bool = True
    # disaggregated mode (``backends`` empty): prefill engines, then decode engines
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()


def options_from_args(args: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """The routing flags' values (see ``add_router_options``)."""
    name = prefix.replace("-", "_")
    fields = ("policy", "balance_threshold", "prefix_min_match", "max_prefix_entries",
              "health_interval_s")
    return {field: getattr(args, name + field) for field in fields}


def check_options(options: RouterOptions) -> list[str]:
    """The backend URLs, checked; ValueError naming the flag otherwise."""
    if bool(options.prefill) != bool(options.decode):
        raise ValueError("--prefill and --decode go together: give at least one of each")
    if options.prefill and options.backends:
        raise ValueError("--backend is for the plain router; with --prefill / --decode "
                         "give the engines there")
    if not options.backends and not options.prefill:
        raise ValueError("give --backend URL ..., or --prefill URL ... --decode URL ...")
    urls = [check_backend_url(url)
            for url in (*options.backends, *options.prefill, *options.decode)]
    duplicates = sorted({url for url in urls if urls.count(url) > 1})
    if duplicates:
        raise ValueError(f"--backend {duplicates[0]} is given twice: give each backend once")
    if not 0 <= options.port < 65536:
        raise ValueError(f"--port={options.port} is invalid: must be in [0, 65535]")
    for flag, value in (("--startup-timeout-s", options.startup_timeout_s),
                        ("--shutdown-timeout", options.shutdown_timeout_s)):
        if not value >= 0:
            raise ValueError(f"{flag}={value} is invalid: must be >= 0")
    return urls


class RouterServer(uvicorn.Server):
    """uvicorn's server, exiting 0 after a graceful stop on SIGTERM / SIGINT
    (uvicorn re-raises the signal it caught); a second signal exits at once."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True


class _DropStartupTraceback(logging.Filter):
    """Drops the traceback that Starlette hands uvicorn to log when the
    start-up check of the backends failed, and uvicorn's "Application startup
    failed" after it: that failure ends the command in one line (``kvserve:
    error: ...``, or ``kvserve: interrupted`` after Ctrl-C) instead."""

    def __init__(self, failure: list[BaseException]) -> None:
        super().__init__()
        self.failure = failure

    def filter(self, record: logging.LogRecord) -> bool:
        return not (self.failure and record.getMessage().startswith(
            ("Traceback", "Application startup failed")))


def build_state(options: RouterOptions) -> Any:
    """The router's shared state (the tokenizer loaded, the policy built)."""
    import httpx

    from kvserve.router.app import RouterState
    from kvserve.router.prompt_key import PromptKeyer

    urls = check_options(options)
    tokenizer = None
    if options.tokenizer is not None:
        from kvserve.engine.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(options.tokenizer)
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=256))

    def state(group: list[str]) -> RouterState:
        policy = policies.make_policy(options.policy, group, options.balance_threshold,
                                      options.max_prefix_entries, options.prefix_min_match)
        pool = BackendPool(group, client, options.health_interval_s, DEFAULT_UNHEALTHY_AFTER,
                           on_recovered=policy.forget)
        return RouterState(pool, policy, PromptKeyer(tokenizer, options.block_size), client)

    if options.prefill:  # disaggregated: (prefill state, decode state)
        num_prefill = len(options.prefill)
        return state(urls[:num_prefill]), state(urls[num_prefill:])
    return state(urls)


async def check_backends(pool: BackendPool, timeout_s: float,
                         abort: Callable[[], str | None] = lambda: None) -> None:
    """Wait for the backends; OSError naming them when none answers (or when
    ``abort`` returns a reason to stop waiting)."""
    down = await pool.wait_healthy(timeout_s, abort)
    named = ", ".join(f"{b.url} ({b.last_error})" for b in down)
    if len(down) == len(pool.backends):
        raise OSError(f"no backend answered within {timeout_s:g} s: {named}")
    if down:
        logger.warning("these backends do not answer yet (they join when they do): %s", named)


def run_router(options: RouterOptions,
               startup_abort: Callable[[], str | None] = lambda: None) -> int:
    """Serve until SIGTERM / Ctrl-C; the exit status. ``startup_abort`` may
    end the wait for the backends with a reason (an OSError)."""
    from kvserve.net import check_port_free
    from kvserve.router.app import build_app
    from kvserve.router.disagg import build_disagg_app

    check_port_free(options.host, options.port)
    logging.getLogger("kvserve").setLevel(
        min(logging.getLogger("kvserve").getEffectiveLevel(), logging.INFO))
    built = build_state(options)
    states = list(built) if isinstance(built, tuple) else [built]
    failure: list[BaseException] = []
    interrupted = False

    def abort() -> str | None:
        nonlocal interrupted
        if server.should_exit:  # Ctrl-C or SIGTERM while the backends are awaited
            interrupted = True
            return "stopped by a signal"
        return startup_abort()

    async def on_start() -> None:
        try:
            for state in states:
                await check_backends(state.pool, options.startup_timeout_s, abort)
        except OSError as exc:
            failure.append(exc)
            raise

    app = (build_disagg_app(states[0], states[1], on_start) if len(states) == 2
           else build_app(states[0], on_start))
    server = RouterServer(uvicorn.Config(
        app, host=options.host, port=options.port,
        log_level=options.uvicorn_log_level, access_log=options.access_log,
        timeout_graceful_shutdown=max(int(options.shutdown_timeout_s), 1), lifespan="on"))
    logger.info("kvserve router: %s policy over %s on http://%s:%d", options.policy,
                " then ".join(", ".join(state.pool.by_url) for state in states),
                options.host, options.port)
    quiet = _DropStartupTraceback(failure)
    logging.getLogger("uvicorn.error").addFilter(quiet)
    try:
        server.run()
    except SystemExit:  # uvicorn's exit after a failed start-up
        if not failure:
            raise
    finally:
        logging.getLogger("uvicorn.error").removeFilter(quiet)
    if failure:
        if interrupted:
            raise KeyboardInterrupt  # the CLI's one line and exit status 130
        raise failure[0]
    if not server.started:
        raise OSError(f"the router could not start on {options.host}:{options.port}")
    return 0


def run_router_command(args: argparse.Namespace) -> int:
    options = RouterOptions(
        backends=args.backend, prefill=tuple(args.prefill), decode=tuple(args.decode),
        host=args.host, port=args.port, tokenizer=args.tokenizer,
        startup_timeout_s=args.startup_timeout_s, shutdown_timeout_s=args.shutdown_timeout,
        uvicorn_log_level=args.uvicorn_log_level, access_log=not args.disable_access_log,
        block_size=args.block_size, **options_from_args(args))
    return run_router(options)

