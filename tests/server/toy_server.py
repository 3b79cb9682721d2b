"""`python -m tests.server.toy_server [serve flags] [--step-delay S]`: the real server app and
uvicorn over the toy engine (no model), for fast subprocess tests."""

from __future__ import annotations

import argparse
import sys

from everystop.engine.args import add_engine_args, config_or_exit
from everystop.engine.async_engine import AsyncEngine
from everystop.engine.llm_engine import LLMEngine
from everystop.server.admin import install_admin_routes
from everystop.server.admission import AdmissionConfig
from everystop.server.app import build_app
from everystop.server.cli import add_server_args, connection_limits, request_limits, run_server
from everystop.server.metrics import ServerMetrics
from tests.server.fakes import ChatCharTokenizer, SlowToyExecutor

MODEL_NAME = "toy"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    add_engine_args(parser)
    parser.add_argument("--step-delay", type=float, default=0.0)
    args = parser.parse_args(argv)
    config = config_or_exit(args)
    num_blocks = config.cache.num_gpu_blocks_override or 256
    executor = SlowToyExecutor(num_blocks, config.cache.block_size, args.step_delay)
    front = AsyncEngine(LLMEngine(config, executor, ChatCharTokenizer()),
                        watchdog_interval_s=0.2,
                        stall_timeout_s=args.engine_stall_timeout or None,
                        slow_reader_timeout_s=args.slow_reader_timeout or None)
    app = build_app(front, MODEL_NAME, api_key=args.api_key, admin_key=args.admin_key,
                    max_n=args.max_n,
                    admission=AdmissionConfig(max_queue_wait_s=args.max_queue_wait_s,
                                              min_samples=1),
                    limits=request_limits(args), open_metrics=args.open_metrics,
                    metrics=ServerMetrics(metric_names=args.metrics_names),
                    extensions=[install_admin_routes])
    return run_server(app, front, args.host, args.port, grace_s=args.grace_period,
                      log_level=args.log_level, connections=connection_limits(args))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
