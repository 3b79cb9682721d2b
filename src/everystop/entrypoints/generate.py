"""`everystop generate PROMPT...`: answer prompts offline and print the text.

The chat template is applied unless --raw is given. Bad input (missing model, corrupt file,
unsupported architecture, inconsistent flags) prints one `everystop: error: ...` line and exits 2.
"""

from __future__ import annotations

import argparse
import logging
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    from everystop.engine.args import add_engine_args

    p = subparsers.add_parser("generate", help="answer prompts offline and print the text",
                              description=__doc__)
    p.add_argument("prompts", nargs="+", help="one or more prompts")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the text")
    p.add_argument("--system", default=None, help="a system message (chat mode)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("-v", "--verbose", action="store_true", help="log start-up details")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from everystop.config import ConfigError
    from everystop.engine.args import engine_options_from_args
    from everystop.sampling_params import SamplingParams, SamplingParamsError

    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                                stop=args.stop)
        llm = _load(engine_options_from_args(args))
    except (ConfigError, SamplingParamsError) as exc:
        return _fail(str(exc))
    except _load_errors() as exc:
        return _fail(str(exc))
    if args.raw:
        outs = llm.generate(args.prompts, params, use_tqdm=False)
    else:
        system = [{"role": "system", "content": args.system}] if args.system else []
        convs = [system + [{"role": "user", "content": p}] for p in args.prompts]
        outs = llm.chat(convs, params, use_tqdm=False)
    for i, out in enumerate(outs):
        if len(outs) > 1:
            print(f"--- [{i}] ({out.finish_reason})")
        print(out.text.strip() if not args.raw else out.text)
    return 0


def _load(options: dict) -> object:
    # On a terminal, say what the wait is for; the line is erased once the model is ready.
    tty = sys.stderr.isatty()
    if tty:
        print("everystop: loading the model...", end="", file=sys.stderr, flush=True)
    try:
        from everystop.engine.llm import LLM
        return LLM(**options)
    finally:
        if tty:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def _load_errors() -> tuple[type[BaseException], ...]:
    from everystop.executor.models.loader import ModelLoadError
    from everystop.tokenizer import TokenizerLoadError
    return (ModelLoadError, TokenizerLoadError, FileNotFoundError)


def _fail(message: str) -> int:
    first_line = message.strip().splitlines()[0] if message.strip() else "unknown error"
    print(f"everystop: error: {first_line}", file=sys.stderr)
    return 2
