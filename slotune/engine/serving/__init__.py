"""The HTTP front end over the engine: the OpenAI-compatible server (`server.py`, FastAPI), its
request models (`api_protocol.py`), the asyncio bridge to the engine loop thread (`async_llm.py`),
Prometheus metrics (`serving_metrics.py`), the traffic recorder (`traffic_recorder.py`) and the event
loop both our HTTP processes run on (`event_loop.py`, uvloop).

The engine core (`slotune.engine`) never imports this package, so building and stepping an
engine needs neither FastAPI nor uvicorn.
"""
