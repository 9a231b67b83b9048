"""The client: a sans-IO core and its blocking and asyncio faces. Torch-free: it imports only the
transport and the errors (and the bottom helpers), so `pip install flowedge` without extras serves it."""
