"""`everystop serve --replicas N`: start (or join) Ray, deploy N engine replicas as one Ray Serve
deployment routed by `EveryStopRouter`, and serve the usual OpenAI app in front of them.

The ingress is this process: the same FastAPI app as one engine (routes, errors, SSE, auth),
whose engine front (`ClusterEngine`) talks to the replicas through a Ray Serve handle. Ray's
own HTTP proxies are not started.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from everystop.config import EngineConfig
from everystop.routing import DEFAULT_AFFINITY_MARGIN

if TYPE_CHECKING:  # the front imports ray
    from everystop.cluster.front import ClusterEngine
    from everystop.engine.client import EngineClient

logger = logging.getLogger("everystop.cluster")

APP_NAME = "everystop"
DEPLOYMENT_NAME = "engine"


@dataclass(frozen=True)
class ClusterOptions:
    num_replicas: int = 2
    ray_address: str | None = None  # None: start a local Ray instance
    policy: str = "least-loaded"
    affinity_margin: float = DEFAULT_AFFINITY_MARGIN
    num_cpus: float | None = None  # per replica; None: its threads x tensor-parallel ranks
    num_gpus: float | None = None  # per replica; None: its ranks on CUDA, else 0
    stats_period_s: float = 0.2
    seed: int = 0


def replica_config(config: EngineConfig, num_replicas: int) -> EngineConfig:
    """Each replica's engine config: on CPU without --threads, the cores split evenly."""
    model = config.model
    if model.device == "cpu" and model.num_threads is None:
        ranks = num_replicas * config.parallel.tensor_parallel_size
        share = max(1, (os.cpu_count() or 1) // ranks)
        model = dataclasses.replace(model, num_threads=share)
    return dataclasses.replace(config, model=model)


def replica_resources(config: EngineConfig, opts: ClusterOptions) -> dict[str, float]:
    ranks = config.parallel.tensor_parallel_size
    on_gpu = config.model.device.startswith("cuda")
    cpus = opts.num_cpus if opts.num_cpus is not None else \
        float((config.model.num_threads or 1) * (1 if on_gpu else ranks))
    gpus = opts.num_gpus if opts.num_gpus is not None else float(ranks if on_gpu else 0)
    return {"num_cpus": cpus, "num_gpus": gpus}


def start_ray(opts: ClusterOptions, resources: dict[str, float]) -> bool:
    """Join `opts.ray_address`, or start a local instance sized for the replicas. Returns
    whether this process started Ray (and so must stop it)."""
    import ray

    if opts.ray_address:
        ray.init(address=opts.ray_address, logging_level=logging.WARNING)
        return False
    # A local instance declares enough CPUs for the replicas even on a small machine: the
    # replicas' threads are what actually share the cores.
    num_cpus = max(os.cpu_count() or 1, int(opts.num_replicas * resources["num_cpus"]) + 1)
    ray.init(num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
             configure_logging=True)
    return True


def deploy(config: EngineConfig, opts: ClusterOptions) -> Any:
    """Deploy the replicas; returns the deployment's handle once every replica is up."""
    from ray import serve

    from everystop.cluster.replica import EngineReplica
    from everystop.cluster.router import EveryStopRouter

    resources = replica_resources(config, opts)
    router = {  # Ray's RequestRouterConfig, as the dict `options` accepts
        "request_router_class": EveryStopRouter,
        "request_router_kwargs": {"policy": opts.policy, "affinity_margin": opts.affinity_margin,
                                  "block_size": config.cache.block_size, "seed": opts.seed},
        "request_routing_stats_period_s": opts.stats_period_s,
        "request_routing_stats_timeout_s": 5.0}
    serve.start(proxy_location="Disabled")
    deployment = cast(Any, serve.deployment)(EngineReplica).options(
        name=DEPLOYMENT_NAME, num_replicas=opts.num_replicas,
        # Admission is the engines' (QueueFull); Ray's own per-replica cap stays out of the way.
        max_ongoing_requests=4096, ray_actor_options=resources,
        health_check_period_s=1.0, health_check_timeout_s=30.0,
        graceful_shutdown_timeout_s=5.0, request_router_config=router,
        # Ray logs every call at INFO; the engine's own logs say what matters.
        logging_config={"log_level": "WARNING"})
    return serve.run(deployment.bind(config), name=APP_NAME, route_prefix=None)


def build_cluster_front(config: EngineConfig, opts: ClusterOptions) -> ClusterEngine:
    """Start Ray, deploy, and return the ingress's `ClusterEngine`."""
    from everystop.cluster.front import ClusterEngine
    from everystop.tokenizer import load_tokenizer

    start_ray(opts, replica_resources(config, opts))
    handle = deploy(config, opts)
    limits = handle.describe.remote().result()
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.model)
    return ClusterEngine(handle, tokenizer, limits, num_replicas=opts.num_replicas)


def install_cluster_routes(app: Any, front: ClusterEngine) -> None:
    """/health/replicas (each replica's state) and the cluster series on /metrics."""
    from fastapi.responses import JSONResponse

    from everystop.cluster.metrics import ClusterCollector

    app.state.ctx.metrics.registry.register(ClusterCollector(front))

    @app.get("/health/replicas")
    async def replica_health() -> JSONResponse:
        states, reports = front.replica_health(), front.reports()
        ok = any(s == "ok" for s in states.values())
        replicas = {rid: {"status": state, **{k: reports.get(rid, {}).get(k) for k in
                                              ("pid", "node", "resources",
                                               "tensor_parallel_size")}}
                    for rid, state in states.items()}
        return JSONResponse({"status": "ok" if ok else "dead", "replicas": replicas},
                            200 if ok else 503)


def stop_cluster(started_ray: bool) -> None:
    """Remove the app; a Ray instance this process started goes with it (and so do its
    replicas: stopping the node stops its workers)."""
    import ray
    from ray import serve

    if started_ray:
        ray.shutdown()
    else:
        serve.delete(APP_NAME)


def options_from_args(args: argparse.Namespace) -> ClusterOptions:
    # "local": a local instance even for one replica (Ray's health checks and restarts).
    address = None if args.ray_address == "local" else args.ray_address
    return ClusterOptions(num_replicas=args.replicas, ray_address=address,
                          policy=args.routing_policy, affinity_margin=args.affinity_margin,
                          num_cpus=args.replica_num_cpus, num_gpus=args.replica_num_gpus,
                          seed=args.seed or 0)


def serve_cluster_command(args: argparse.Namespace) -> int:
    """The `everystop serve --replicas N` path (see server/cli.py for the flags)."""
    from everystop.engine.args import config_or_exit

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve_cluster(args, config_or_exit(args))


# Server flags the cluster ingress does not honour, with their single-engine defaults: set to
# anything else, they are refused at start-up rather than silently ignored.
UNSUPPORTED_FLAGS = {"telemetry_db": None, "engine_stall_timeout": 600.0,
                     "slow_reader_timeout": 60.0}


def unsupported_flags(args: argparse.Namespace) -> list[str]:
    """The `--flag`s given that cluster mode would ignore."""
    return ["--" + name.replace("_", "-") for name, default in UNSUPPORTED_FLAGS.items()
            if getattr(args, name, default) != default]


def serve_cluster(args: argparse.Namespace, config: EngineConfig) -> int:
    import sys

    from everystop.cluster.admin import install_cluster_admin
    from everystop.server.admission import AdmissionConfig
    from everystop.server.app import build_app
    from everystop.server.cli import (
        connection_limits,
        request_limits,
        run_server,
        served_model_names,
    )
    from everystop.server.metrics import ServerMetrics

    if unsupported := unsupported_flags(args):
        print(f"everystop: cannot start: {', '.join(unsupported)} not supported with --replicas "
              "(each replica is its own engine; see docs/scale-out.md)", file=sys.stderr)
        return 2
    opts = options_from_args(args)
    config = replica_config(config, opts.num_replicas)
    started = opts.ray_address is None
    front = build_cluster_front(config, opts)
    try:
        names = ([args.served_model_name] if args.served_model_name
                 else served_model_names(config.model.model))
        def cluster_routes(app: Any, _: EngineClient) -> None:
            install_cluster_routes(app, front)
            install_cluster_admin(app, front)

        app = build_app(front, names[0], aliases=names, api_key=args.api_key,
                        admin_key=args.admin_key, max_n=args.max_n, metrics=ServerMetrics(),
                        limits=request_limits(args), open_metrics=args.open_metrics,
                        admission=AdmissionConfig(max_queue_wait_s=args.max_queue_wait_s),
                        extensions=[cluster_routes])
        logger.info("serving %d replicas (policy %s) on http://%s:%d", opts.num_replicas,
                    opts.policy, args.host, args.port)
        return run_server(app, front, args.host, args.port, grace_s=args.grace_period,
                          log_level=args.log_level, connections=connection_limits(args))
    finally:
        stop_cluster(started)
