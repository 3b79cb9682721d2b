"""The one way benchmark scripts report: the result JSON on stdout, and in `out` when given."""

from __future__ import annotations

import json
from typing import Any


def emit(result: dict[str, Any], out: str | None) -> None:
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")
