"""A gateway app: each line a device sends over TCP is a prompt; the answer streams back, then a line of
figures. It type-checks under `mypy --strict` against the installed client (tests/test_docs.py)."""
from __future__ import annotations

import asyncio
import sys

from flowedge import Answer, AsyncClient, Client, FlowedgeError

HEAD = "127.0.0.1:5555"


def head_ready(addr: str = HEAD) -> bool:
    with Client(addr, timeout_s=2.0) as client:
        return bool(client.status()[0].get("ready"))


def summary(answer: Answer) -> str:
    rate = answer.wall_tokens_per_s or 0.0
    return (f"\n[{answer.usage.completion_tokens} tokens, {rate:.1f} tok/s, {answer.finish_reason}, "
            f"{answer.stats.strategy}]\n")


async def serve(client: AsyncClient, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    while line := (await reader.readline()).decode().strip():
        try:
            async for chunk in client.chunks(line, system="Be brief.", max_tokens=128, temperature=0.7,
                                             top_p=0.9, seed=7, stop=["\n\n"]):
                writer.write((summary(chunk.answer) if chunk.answer else chunk.text).encode())
                await writer.drain()
        except FlowedgeError as err:
            writer.write(f"error: {err}\n".encode())
    writer.close()


async def main(port: int) -> None:
    async with AsyncClient(HEAD) as client:
        server = await asyncio.start_server(lambda r, w: serve(client, r, w), "127.0.0.1", port)
        async with server:
            await server.serve_forever()


if __name__ == "__main__":
    if not head_ready():
        sys.exit(f"the head at {HEAD} is not ready")
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 7000))
