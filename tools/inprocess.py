"""Run consumer and producer servers in-process on free ports, on a background event loop.

Used by the integration tests and by benchmarks that need both services in one process."""

from __future__ import annotations

import asyncio
import threading
from typing import Callable


class InProcessServices:
    """``with InProcessServices(consumers, make_producer) as svc: svc.producer_address``.

    ``consumers`` is a list of ConsumerEngine; ``make_producer(addresses: dict[name, addr])``
    returns a ProducerEngine configured with those consumer addresses."""

    def __init__(self, consumers: list, make_producer: Callable[[dict[str, str]], object] | None):
        self._consumers, self._make_producer = consumers, make_producer
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.servers: list = []
        self.consumer_addresses: dict[str, str] = {}
        self.consumer_servers: dict[str, object] = {}  # name -> GRPCServer (``.servicer``: metrics, admission)
        self.producer_address = ""
        self.producer_engine = None
        self.producer_server = None

    def _run(self, coro, timeout=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    async def _start(self):
        from consumer_service.server import build_server as build_consumer
        from producer_service.server import build_server as build_producer

        for eng in self._consumers:
            srv = build_consumer(eng)
            port = await srv.start()
            self.servers.append(srv)
            self.consumer_servers[eng.settings.name] = srv
            self.consumer_addresses[eng.settings.name] = f"127.0.0.1:{port}"
        if self._make_producer is None:  # consumers only (tests that play the producer themselves)
            self._servicer = None
            return
        self.producer_engine = self._make_producer(dict(self.consumer_addresses))
        srv, self._servicer = build_producer(self.producer_engine)
        port = await srv.start()
        self.servers.append(srv)
        self.producer_server = srv
        self.producer_address = f"127.0.0.1:{port}"

    async def _stop(self):
        for srv in reversed(self.servers):
            await srv.stop(0.5)
        if self._servicer is not None:
            await self._servicer.close()

    def __enter__(self):
        self._thread.start()
        self._run(self._start())
        return self

    def __exit__(self, *exc):
        try:
            self._run(self._stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(5)
            for eng in [*self._consumers, self.producer_engine]:
                if eng is not None:
                    eng.close()
