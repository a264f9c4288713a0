"""The least a proxy can be: a keep-alive HTTP/1.1 relay that does nothing but pass bytes.

``bench.embeddings --floor`` puts it where the gateway stands (on the gateway's core, in front
of the same engine) to measure what any proxy costs the engine's throughput on that machine,
apart from what the gateway does itself. Each client connection gets one connection to the
engine of its own; a message is read whole (by its ``content-length``) and written on in one
piece. ``--burn-us N`` spends N µs of CPU on each request before it is passed on, half before
the engine is sent it and half after its answer: a proxy doing that much work.

    python -m bench.floor_proxy ENGINE_HOST ENGINE_PORT LISTEN_PORT [--burn-us N]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop


async def read_message(reader: asyncio.StreamReader) -> tuple[bytes, bytes, int | None]:
    """One HTTP/1.1 message read whole: (its head, its body, its declared size or None: no
    body read)."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = None
    for line in head.lower().split(b"\r\n"):
        if line.startswith(b"content-length:"):
            length = int(line[15:])
    return head, await reader.readexactly(length) if length else b"", length


def _burn(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


async def serve(engine_host: str, engine_port: int, port: int, burn_us: float) -> None:
    half = burn_us / 2e6

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_writer = None
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(
                engine_host, engine_port
            )
            while True:
                head, body, _ = await read_message(reader)
                _burn(half)
                upstream_writer.write(head + body)
                head, body, _ = await read_message(upstream_reader)
                _burn(half)
                writer.write(head + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # either side closed (or the engine refused): so does the other
        finally:
            if upstream_writer is not None:
                upstream_writer.close()
            writer.close()

    server = await asyncio.start_server(relay, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("engine_host")
    parser.add_argument("engine_port", type=int)
    parser.add_argument("port", type=int)
    parser.add_argument("--burn-us", type=float, default=0, help="CPU spent on each request")
    args = parser.parse_args()
    uvloop.run(serve(args.engine_host, args.engine_port, args.port, args.burn_us))


if __name__ == "__main__":
    main()
