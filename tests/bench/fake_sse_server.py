"""A tiny OpenAI-style streaming server with known timings, on 127.0.0.1 (raw asyncio).

Each request streams `max_tokens` one-token chunks: the first after `ttft_s`, the rest `itl_s`
apart, then a usage chunk and [DONE]. A prompt containing "FAIL" gets HTTP 500. Connections
close after each response (no keep-alive), which every HTTP client handles.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field


@dataclass
class FakeServer:
    ttft_s: float = 0.05
    itl_s: float = 0.01
    received: list[dict] = field(default_factory=list)
    server: asyncio.AbstractServer | None = None
    port: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = {k.lower(): v.strip() for k, v in
                       (line.split(":", 1) for line in lines[1:] if ":" in line)}
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            if method == "GET" and path == "/v1/models":
                await self._json(writer, {"object": "list", "data": [{"id": "fake-model"}]})
            elif method == "POST" and path in ("/v1/completions", "/v1/chat/completions"):
                await self._stream(writer, json.loads(body), chat="chat" in path)
            else:
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n"
                             b"Connection: close\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()

    async def _json(self, writer: asyncio.StreamWriter, obj: dict) -> None:
        data = json.dumps(obj).encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(data)).encode() + b"\r\nConnection: close\r\n\r\n" + data)

    async def _stream(self, writer: asyncio.StreamWriter, req: dict, chat: bool) -> None:
        self.received.append(req)
        prompt = json.dumps(req.get("messages")) if chat else req.get("prompt", "")
        if "FAIL" in prompt:
            writer.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n"
                         b"Connection: close\r\n\r\nboom")
            return
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                     b"Connection: close\r\n\r\n")
        await writer.drain()
        n = int(req["max_tokens"])
        for i in range(n):
            await asyncio.sleep(self.ttft_s if i == 0 else self.itl_s)
            choice = ({"index": 0, "delta": {"content": f" w{i}"}} if chat
                      else {"index": 0, "text": f" w{i}"})
            self._event(writer, {"id": "x", "choices": [choice]})
            await writer.drain()
        self._event(writer, {"id": "x", "choices": [],
                             "usage": {"prompt_tokens": 3, "completion_tokens": n}})
        writer.write(b"data: [DONE]\n\n")

    @staticmethod
    def _event(writer: asyncio.StreamWriter, obj: dict) -> None:
        writer.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
