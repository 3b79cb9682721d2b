"""`everystop serve`: load the engine, start its loop thread, serve the app with uvicorn.

SIGTERM drains: admission stops (new requests get 503, /health says draining), in-flight
requests get up to --grace-period seconds to finish, the rest are aborted (their clients get
finish_reason "abort"), then the server exits 0. A second SIGTERM or SIGINT exits at once.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import pathlib
import re
import signal
import sys
from types import FrameType
from typing import Any

import uvicorn

from everystop.engine.args import add_engine_args, config_or_exit, parse_bytes
from everystop.server.admission import AdmissionConfig
from everystop.server.connections import ConnectionLimits, guarded_protocol
from everystop.server.heap_trim import start_heap_trimming
from everystop.server.limits import RequestLimits
from everystop.server.metrics_names import METRIC_NAMES
from everystop.server.runtime_stats import freeze_startup_heap
from everystop.startup_memory import checkpoint, log_stages

logger = logging.getLogger("everystop.server")


def _wait_caps(text: str) -> tuple[float, float, float]:
    parts = [float(p) for p in text.split(",")]
    if len(parts) == 1:
        parts *= 3
    if len(parts) != 3 or min(parts) < 0:
        raise argparse.ArgumentTypeError(f"expected S or S0,S1,S2 seconds >= 0, got {text!r}")
    return (parts[0], parts[1], parts[2])


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return value


def _key(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("a key must not be empty (an empty key opens the door)")
    return text


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def scaled_out(args: argparse.Namespace) -> bool:
    """`serve` on Ray (everystop.cluster) rather than one engine in this process."""
    return getattr(args, "replicas", 1) > 1 or bool(getattr(args, "ray_address", None))


def add_server_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (loopback by default)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", type=_key, default=None,
                   help="require 'Authorization: Bearer KEY' on /v1 (and on operator routes "
                        "when there is no --admin-key); docs/access.md")
    g.add_argument("--served-model-name", default=None,
                   help="the model name clients send (default: the model file's stem without "
                   "its quantization suffix; the full stem is accepted too)")
    g.add_argument("--max-queue-wait", dest="max_queue_wait_s", type=_wait_caps,
                   default=(0.0, 0.0, 0.0),
                   help="per tier S or S0,S1,S2: answer 429 when the expected queue wait "
                        "exceeds S seconds (0 = off)")
    g.add_argument("--max-n", type=int, default=8, help="largest n (choices per request)")
    g.add_argument("--grace-period", type=float, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    g.add_argument("--log-level", default="info")
    g.add_argument("--telemetry-db", default=None,
                   help="telemetry store: a SQLite path or a postgresql:// DSN (off when unset)")
    g.add_argument("--admin-key", type=_key, default=None,
                   help="key for the operator routes, /admin and /dashboard/data "
                        "(Authorization: Bearer or X-Admin-Key); with no key at all they "
                        "answer loopback clients only (docs/access.md)")
    g.add_argument("--engine-stall-timeout", type=float, default=600.0,
                   help="seconds one engine iteration may run before the engine is declared "
                        "dead (/health 503, streams end with an error); 0 = never")
    g.add_argument("--slow-reader-timeout", type=float, default=60.0,
                   help="seconds a client may leave its stream unread (tokens waiting) before "
                        "its request is aborted and its blocks freed; 0 = never")
    g.add_argument("--header-timeout", type=_seconds, default=10.0,
                   help="seconds a connection gets to send a request's complete headers (after "
                        "opening, or after its previous response) before it is closed "
                        "(slowloris); 0 = never")
    g.add_argument("--send-buffer-bytes", type=parse_bytes,
                   default=ConnectionLimits.send_buffer_bytes,
                   help="kernel send buffer of each connection (default 128KiB), so a client "
                        "that stops reading blocks the stream within KBs and --slow-reader-"
                        "timeout can see it; 0 = the kernel's own (grows to MBs)")
    g.add_argument("--heap-trim-interval", type=float, default=30.0,
                   help="seconds between returns of the C heap's free pages to the kernel "
                        "(glibc malloc_trim; see server/heap_trim.py); 0 = never")
    g.add_argument("--metrics-names", choices=METRIC_NAMES, default="everystop",
                   help="/metrics series names: ours (everystop:*), vLLM's (vllm:*) for the "
                   "series vLLM has, or both")
    g.add_argument("--open-metrics", action="store_true",
                   help="serve /metrics without --api-key (a scraper on a private network)")
    lim = parser.add_argument_group("request limits (answered 413/400 naming the limit)")
    d = RequestLimits()
    lim.add_argument("--max-body-bytes", type=parse_bytes, default=d.max_body_bytes,
                     help="largest request body (default 8MiB)")
    lim.add_argument("--max-json-depth", type=int, default=d.max_json_depth,
                     help="deepest JSON nesting in a body")
    lim.add_argument("--max-prompts", type=int, default=d.max_prompts,
                     help="most prompts in one /v1/completions request")
    lim.add_argument("--max-request-sequences", type=int, default=d.max_sequences,
                     help="most sequences (prompts x n) one request may start")
    lim.add_argument("--max-token-ids", type=int, default=d.max_token_ids,
                     help="most token ids in one request's prompt(s) or /detokenize list")
    c = parser.add_argument_group("scale out (Ray Serve; pip install everystop[cluster])")
    c.add_argument("--replicas", type=_positive_int, default=1,
                   help="engine replicas behind one ingress (>1, or --ray-address, uses Ray)")
    c.add_argument("--ray-address", default=None,
                   help="join this Ray cluster ('auto' after `ray start`); 'local': start one "
                        "even for a single replica; default: start one when --replicas > 1")
    c.add_argument("--routing-policy", default="least-loaded",
                   choices=["least-loaded", "prefix-affinity", "power-of-two", "round-robin"])
    # everystop.routing.DEFAULT_AFFINITY_MARGIN (the server floor does not import routing)
    c.add_argument("--affinity-margin", type=float, default=4.0,
                   help="prefix-affinity: how much more loaded (score units: ~512 queued "
                        "prompt tokens) the prefix's replica may be and still be chosen")
    c.add_argument("--replica-num-cpus", type=float, default=None,
                   help="CPUs Ray reserves per replica (default: its threads x "
                        "tensor-parallel ranks)")
    c.add_argument("--replica-num-gpus", type=float, default=None,
                   help="GPUs Ray reserves per replica (default: its tensor-parallel ranks on "
                        "CUDA, else 0)")


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    add_server_args(p)
    add_engine_args(p)
    p.set_defaults(func=serve)


def serve(args: argparse.Namespace) -> int:
    checkpoint("server imports")
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = config_or_exit(args)
    from everystop.engine.async_engine import AsyncEngine
    from everystop.engine.llm_engine import LLMEngine
    from everystop.server.admin import install_admin_routes, install_telemetry
    from everystop.server.app import build_app
    from everystop.server.dashboard import install_dashboard
    from everystop.server.lora_admin import install_lora_routes
    from everystop.server.metrics import ServerMetrics

    try:
        # Built on the engine thread: all torch work on one thread (see AsyncEngine).
        front = AsyncEngine(lambda: LLMEngine.from_config(config),
                            stall_timeout_s=args.engine_stall_timeout or None,
                            slow_reader_timeout_s=args.slow_reader_timeout or None)
    except Exception as exc:  # a bad model path or config: one line, not a traceback
        if type(exc).__name__ not in ("ConfigError", "ModelLoadError", "TokenizerLoadError",
                                      "LoraLoadError"):
            raise
        print(f"everystop: cannot start: {exc}", file=sys.stderr)
        return 2
    engine = front.engine
    # An explicit --served-model-name is the only name; otherwise the clean name and the stem.
    names = ([args.served_model_name] if args.served_model_name
             else served_model_names(engine.model_path or config.model.model))
    name = names[0]
    clash = set(names) & set(engine.lora_adapters())
    if clash:
        print(f"everystop: cannot start: LoRA adapter name {sorted(clash)[0]!r} is the base "
              "model's name", file=sys.stderr)
        front.shutdown()
        return 2
    metrics = ServerMetrics(metric_names=args.metrics_names)

    def observability(app: Any, front: Any) -> None:
        telemetry = install_telemetry(app, front, db=args.telemetry_db,
                                      registry=metrics.registry, model_version=name)
        install_admin_routes(app, front, store=telemetry.store, telemetry=telemetry)
        install_lora_routes(app, front)
        metrics.loop_lag_listeners.append(
            lambda lag_s: telemetry.guardrails.on_loop_lag(lag_s, front.clock()))
        install_dashboard(app, front, metrics)

    app = build_app(front, name, aliases=names, api_key=args.api_key,
                    admin_key=args.admin_key, max_n=args.max_n,
                    metrics=metrics, limits=request_limits(args),
                    open_metrics=args.open_metrics,
                    admission=AdmissionConfig(max_queue_wait_s=args.max_queue_wait_s),
                    extensions=[observability])
    checkpoint("app")
    return run_server(app, front, args.host, args.port, grace_s=args.grace_period,
                      log_level=args.log_level, heap_trim_interval_s=args.heap_trim_interval,
                      connections=connection_limits(args))


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
                         max_prompts=args.max_prompts, max_sequences=args.max_request_sequences,
                         max_token_ids=args.max_token_ids)


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """A connection that stalls its writes as long as a stream may go unread is closed too."""
    return ConnectionLimits(header_timeout_s=args.header_timeout or None,
                            send_buffer_bytes=args.send_buffer_bytes,
                            write_stall_timeout_s=args.slow_reader_timeout or None)


# A GGUF file's quantization suffix: "SmolLM2-135M-Instruct.Q4_1", "Llama-3-8B-Q4_K_M".
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d\w*|F16|F32|BF16|FP16|FP32)$", re.IGNORECASE)


def served_model_names(path: str | None) -> list[str]:
    """The names a client may send for the model at `path`, the served name first: the file
    stem without its quantization suffix (what the README and HF call it), then the full stem.

    NOTE: not the GGUF's general.name: it is often spaced prose ("SmolLM2 135M Instruct"), and
    reading it costs a metadata pass the server would otherwise not make."""
    if not path:
        return ["SmolLM2-135M-Instruct"]  # the default model
    p = pathlib.Path(str(path))
    stem = p.stem if p.suffix == ".gguf" else p.name
    clean = _QUANT_SUFFIX.sub("", stem) or stem
    return list(dict.fromkeys([clean, stem]))


class _DrainingServer(uvicorn.Server):
    """uvicorn, except the first SIGTERM drains the engine before uvicorn shuts down."""

    def __init__(self, config: uvicorn.Config, front: Any, grace_s: float) -> None:
        super().__init__(config)
        self.front = front
        self.grace_s = grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        loop = self._loop
        if sig == signal.SIGTERM and not self._draining and loop is not None:
            self._draining = True
            self.front.draining = True  # before the next request is read: 503 from here on
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))
            return
        super().handle_exit(sig, frame)

    async def _drain(self) -> None:
        logger.info("SIGTERM: draining %d in-flight requests (grace %.0fs)",
                    self.front.num_in_flight, self.grace_s)
        await self.front.drain(self.grace_s)
        # Let the aborted streams write their final frames.
        for _ in range(40):
            if not self.front.num_in_flight:
                break
            await asyncio.sleep(0.05)
        self.should_exit = True


def run_server(app: Any, front: Any, host: str, port: int, *, grace_s: float = 30.0,
               log_level: str = "info", heap_trim_interval_s: float = 0.0,
               connections: ConnectionLimits | None = None) -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code (0 after a clean drain)."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level.lower(),
                            timeout_graceful_shutdown=max(1, int(grace_s) + 5),
                            timeout_keep_alive=5,
                            http=guarded_protocol(connections or ConnectionLimits()))
    server = _DrainingServer(config, front, grace_s)
    # Everything alive now lives as long as the server: out of the collector's reach, so that a
    # full collection no longer stops the event loop for ~170 ms (see runtime_stats).
    freeze_startup_heap()
    start_heap_trimming(heap_trim_interval_s)
    checkpoint("ready")
    log_stages()
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises a captured Ctrl-C after its own shutdown
        pass
    finally:
        front.shutdown()
    return 0
