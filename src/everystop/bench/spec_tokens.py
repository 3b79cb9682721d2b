"""`bench speculative`'s lossless check: does each speculating method emit exactly the text it
emits with speculation off?

The timed runs cannot tell: with 16-bit activations a row's numbers depend on what else is in
its pass (a GEMM tile's summation order, the attention kernel's split), so speculation off
itself emits different text for a request alone and in a batch of 32, and a verify pass (a
row of 1 + k query tokens) differs from the decode rows it replaces for the same reason. So
off and every method run once more with `--batch-invariant` (ModelConfig.batch_invariant: each
row computes as it would alone) and fp32 activations, every request of the measured scenarios
sent at once, greedy; a method passes when each request's text equals off's. Any difference
left is speculation's own.

Why fp32 there: it is the mode whose exactness the tests check; bf16 logits near 16 round to
steps of 0.125, so greedy often faces exact ties, where any difference in summation order
decides.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Callable
from typing import Any

import httpx

from everystop.workload import Workload

CHECK_DTYPE = "float32"  # the exact mode: see the module docstring
BASELINE = ("batch-invariant servers with fp32 activations, every request at once, greedy: "
            "text equal to off's")


async def _texts(url: str, workloads: dict[str, tuple[Workload, int, bool]]
                 ) -> dict[str, str]:
    """Each request's completion text (keyed workload/request id), all sent at once."""
    from everystop.bench.client import discover_model

    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0, connect=30.0)) as client:
        model = await discover_model(client, url)

        async def one(key: str, body: dict[str, Any]) -> tuple[str, str]:
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            return key, str(r.json()["choices"][0]["text"])

        jobs, seen = [], set()
        for wl, _, natural in workloads.values():
            for req in wl.requests:
                key = f"{wl.name}/{req.id}"
                if key in seen:
                    continue  # one workload in two scenarios (alone, 32 at once): once here
                seen.add(key)
                body = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0,
                        "ignore_eos": not natural,
                        "prompt": req.prompt_token_ids or req.prompt}
                jobs.append(one(key, body))
        return dict(await asyncio.gather(*jobs))


def differing(texts: dict[str, dict[str, str]]) -> dict[str, list[str]]:
    """Per method other than off: the requests whose text is not off's."""
    off = texts["off"]
    return {method: [key for key in off if got.get(key) != off[key]]
            for method, got in texts.items() if method != "off"}


def check_flags(timed: list[str]) -> list[str]:
    """A timed run's `everystop serve` flags made batch-invariant with fp32 activations."""
    flags = [*timed, "--batch-invariant"]
    flags[flags.index("--dtype") + 1] = CHECK_DTYPE
    return flags


def check_tokens(methods: list[str], timed_flags: Callable[[str], list[str]],
                 workloads: dict[str, tuple[Workload, int, bool]]) -> dict[str, Any]:
    """Run off and each of `methods` (`timed_flags(method)`: the timed run's serve flags)
    batch-invariant in fp32; {"baseline", "same": {method: bool}, "differing": {method:
    [requests]}, "commands"}."""
    from everystop.bench.servers import everystop_server

    texts: dict[str, dict[str, str]] = {}
    commands = {}
    for method in ["off", *(m for m in methods if m != "off")]:
        flags = check_flags(timed_flags(method))
        print(f"+ everystop {method} (batch-invariant, the token check)", flush=True)
        with everystop_server(flags, failure=f"everystop serve {shlex.join(flags)} did not "
                                             "come up") as (_, url):
            texts[method] = asyncio.run(_texts(url, workloads))
        commands[method] = shlex.join(["everystop", "serve", *flags])
    diff = differing(texts)
    return {"baseline": BASELINE, "same": {m: not keys for m, keys in diff.items()},
            "differing": diff, "commands": commands}
