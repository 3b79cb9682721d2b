"""Structured output on the default model: 50 chat prompts, each with a JSON schema (objects,
enums, arrays, nesting), all in one batch; every output must parse and validate.

    everystop bench structured-output [--prompts 50] [--temperature 0]
        [--out benchmarks/results/structured_output.json]

The cost of structured output is timed where it is paid: the engine filling the bitmasks
before each pass, and the sampler applying them, as a share of the run's wall time. (A
tokens-per-second comparison against the same prompts without schemas would mostly measure
how long the unconstrained texts run on.) Validation is the `jsonschema` package's.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from everystop.results import write_result
from everystop.sampling_params import SamplingParams, StructuredOutput

NAME = {"type": "string", "maxLength": 24}
SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", {"type": "object", "properties": {
        "name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["engineer", "teacher", "artist", "doctor"]}},
        "required": ["name", "age", "role"]}),
    ("a city", {"type": "object", "properties": {
        "city": NAME, "country": NAME,
        "landmarks": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["city", "country", "landmarks"]}),
    ("a book", {"type": "object", "properties": {
        "title": NAME, "author": {"type": "object", "properties": {
            "first": NAME, "last": NAME}, "required": ["first", "last"]},
        "year": {"type": "integer"}, "genre": {"enum": ["fiction", "history", "science"]}},
        "required": ["title", "author", "year", "genre"]}),
    ("a recipe", {"type": "object", "properties": {
        "dish": NAME, "vegetarian": {"type": "boolean"},
        "steps": {"type": "array", "items": {"type": "object", "properties": {
            "n": {"type": "integer"}, "do": NAME}, "required": ["n", "do"]},
            "minItems": 1, "maxItems": 3}},
        "required": ["dish", "vegetarian", "steps"]}),
    ("the weather", {"type": "object", "properties": {
        "sky": {"enum": ["sunny", "cloudy", "rainy", "snowy"]},
        "celsius": {"type": "number"}, "wind": {"type": "object", "properties": {
            "speed_kmh": {"type": "integer"}, "from": {"enum": ["N", "E", "S", "W"]}},
            "required": ["speed_kmh", "from"]}},
        "required": ["sky", "celsius", "wind"]}),
]
SUBJECTS = ["in Japan", "from the 1900s", "for children", "in winter", "near the sea",
            "from a novel", "in a big city", "that is unusual", "in France", "for a holiday"]


def prompts(n: int) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for i in range(n):
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        subject = SUBJECTS[(i // len(SCHEMAS)) % len(SUBJECTS)]
        out.append((f"Describe {what} {subject} as JSON.", schema))
    return out


def _time_calls(llm: Any, spent: dict[str, Any]) -> None:
    """Accumulate the time spent filling (engine) and applying (sampler) the masks."""
    import everystop.executor.sampler as sampler

    fill, apply = llm.engine.structured.fill_bitmasks, sampler.apply_token_bitmasks

    def timed_fill(*a: Any) -> None:
        t = time.perf_counter()
        fill(*a)
        spent["fill_bitmasks_s"] += time.perf_counter() - t

    def timed_apply(*a: Any) -> Any:
        t = time.perf_counter()
        out = apply(*a)
        spent["apply_bitmasks_s"] += time.perf_counter() - t
        spent["steps_with_masks"] += 1
        return out

    llm.engine.structured.fill_bitmasks = timed_fill  # type: ignore[method-assign]
    sampler.apply_token_bitmasks = timed_apply


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out")


def run(args: argparse.Namespace) -> int:
    """Exit status 1 when an output fails to parse or validate."""
    import jsonschema

    from everystop import LLM

    llm = LLM(max_num_seqs=max(args.prompts, 8))
    spent = {"fill_bitmasks_s": 0.0, "apply_bitmasks_s": 0.0, "steps_with_masks": 0}
    _time_calls(llm, spent)
    work = prompts(args.prompts)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i,
                             structured_output=StructuredOutput("json_schema", json.dumps(s)))
              for i, (_, s) in enumerate(work)]
    t = time.perf_counter()
    outs = llm.chat([[{"role": "user", "content": p}] for p, _ in work], params, use_tqdm=False)
    wall = time.perf_counter() - t
    failures: list[dict[str, Any]] = []
    for (prompt, schema), o in zip(work, outs):
        try:
            jsonschema.validate(json.loads(o.text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            failures.append({"prompt": prompt, "text": o.text, "finish_reason": o.finish_reason,
                             "error": str(exc).splitlines()[0]})
    tokens = sum(len(o.token_ids) for o in outs)
    masks_s = spent["fill_bitmasks_s"] + spent["apply_bitmasks_s"]
    write_result({"bench": "structured_output", "prompts": args.prompts,
          "temperature": args.temperature, "max_tokens": args.max_tokens,
          "valid": args.prompts - len(failures), "failures": failures, "wall_s": wall,
          "output_tokens": tokens, "output_tok_per_s": tokens / wall, **spent,
          "mask_share_of_wall": masks_s / wall,
          "mask_ms_per_step": 1e3 * masks_s / max(1, spent["steps_with_masks"]),
          "load_avg": os.getloadavg()}, args.out)
    return 1 if failures else 0
