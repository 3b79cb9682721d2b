"""The one way benchmark scripts report: the result JSON on stdout, and in `out` when given,
with the CPU it ran on (model, ISA flags, load) unless the result already names it."""

from __future__ import annotations

import json
from typing import Any

from everystop.bench.machine import cpu_info


def emit(result: dict[str, Any], out: str | None) -> None:
    result.setdefault("cpu", cpu_info())
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
