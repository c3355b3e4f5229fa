"""The event loop our HTTP processes run on: uvloop (libuv), as uvicorn's `standard` extra and vLLM's
API server choose it.

Both sides of a served replay run on it: `tune serve`'s event loop (`server.py`) and the replay client
(`slotune/tuner/measure/http_replay.py`). On a CPU host the time the event loops spend per streamed token is
taken from the engine's OpenMP threads, about twice over (docs/design/engine-serving.md).
Standard library and uvloop only: the client process imports this without torch.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on a new uvloop event loop."""
    return uvloop.run(main)
