"""The routers alive in this process, for the ingress to read.

Ray builds the router itself, from a copy of `router.py` it pickles by value, so a registry
kept in that module would be a copy too: it lives here, in a module imported by name.
"""

from __future__ import annotations

import weakref
from typing import Any

_LIVE: weakref.WeakSet[Any] = weakref.WeakSet()


def add(router: Any) -> None:
    _LIVE.add(router)


def live_routers() -> list[Any]:
    """Every `EveryStopRouter` built in this process (one per handle to the deployment)."""
    return list(_LIVE)
