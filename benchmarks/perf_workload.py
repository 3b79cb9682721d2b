"""A small seeded workload for the performance benchmarks: 128 requests, all at t=0, prompts of
32-512 tokens (~35k in all) and long-tailed outputs of 16-256 tokens (~13k in all), ignore_eos.

Prompts are slices of English text (Python's own pydoc topics) cut at exact token counts, so
every engine under test receives the same token ids. The JSON matches the shared workload
format (everystop.bench.workload), with `prompt_token_ids` added.

    python benchmarks/perf_workload.py --out /tmp/perf_workload.json
"""

from __future__ import annotations

import argparse
import json
import random
from typing import Any

NUM_REQUESTS = 128
PROMPT_RANGE = (32, 512)
OUTPUT_RANGE = (16, 256)


def _corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def _output_len(rng: random.Random) -> int:
    # Long tail: log-uniform-ish with most mass at the short end (mean ~100).
    lo, hi = OUTPUT_RANGE
    return int(min(hi, max(lo, round(rng.lognormvariate(4.35, 0.75)))))


def make_workload(tokenizer: Any, seed: int = 0, num_requests: int = NUM_REQUESTS
                  ) -> dict[str, Any]:
    """The workload as a dict (shared workload JSON format plus prompt_token_ids)."""
    rng = random.Random(seed)
    ids = tokenizer.encode(_corpus_text())
    requests = []
    for i in range(num_requests):
        n = rng.randint(*PROMPT_RANGE)
        start = rng.randrange(0, len(ids) - n)
        prompt_ids = [int(t) for t in ids[start:start + n]]
        requests.append({"id": f"r{i}", "prompt": tokenizer.decode(prompt_ids), "prompt_len": n,
                         "prompt_token_ids": prompt_ids, "max_tokens": _output_len(rng),
                         "arrival_s": None, "priority": 1, "tenant": "default",
                         "prefix_group": None})
    spec = {"num_requests": num_requests, "prompt_range": PROMPT_RANGE,
            "output_range": OUTPUT_RANGE, "output_dist": "lognormal(4.35, 0.75) clipped",
            "arrival": "all at t=0", "ignore_eos": True}
    return {"name": "perf-mixed-128", "seed": seed, "spec": spec, "requests": requests}


def summary(workload: dict[str, Any]) -> dict[str, int]:
    reqs = workload["requests"]
    return {"num_requests": len(reqs), "prompt_tokens": sum(r["prompt_len"] for r in reqs),
            "output_tokens": sum(r["max_tokens"] for r in reqs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-requests", type=int, default=NUM_REQUESTS)
    args = ap.parse_args()
    from everystop.tokenizer import load_tokenizer

    w = make_workload(load_tokenizer(), args.seed, args.num_requests)
    with open(args.out, "w") as f:
        json.dump(w, f)
    print(json.dumps(summary(w)))


if __name__ == "__main__":
    main()
