"""`flowedge http`: an OpenAI-compatible HTTP API in front of a head (FastAPI on uvicorn).

settings.py  what the server is told (listen address, API keys, timeouts) and the exposure rule
guard.py     bearer API keys and the request-body guard (Content-Length, read timeout, size)
schema.py    the OpenAI request bodies (pydantic) and the answers and stream chunks built from results
metrics.py   Prometheus metrics: this process's request counters plus the head's status
app.py       the routes; each request talks to the head through its own AsyncClient
clients.py   whom a request is for (its API key's name, else its address): the head's fair queue lanes
"""
