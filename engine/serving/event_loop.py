"""The event loop our HTTP processes run on: uvloop (libuv), as uvicorn's `standard` extra and vLLM's
API server choose it.

Both sides of a served replay run on it: `tune serve`'s event loop (`server.py`) and the replay
client (`tuner/http_bench.py`). On a CPU host the engine's OpenMP threads keep every core busy, and
any other CPU work on the machine stalls their parallel regions: Python work beside the engine
costs about twice its share of the machine in tokens/s (`bench/peers/colocated-*.md`), whether it
runs in the engine's process or in another one. So every microsecond the event loops spend per
streamed token is taken from the engine, twice over (`bench/peers/README.md`, "Where the server's
cost comes from").
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
