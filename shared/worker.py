"""One worker thread per engine for torch work: keeps the event loop free and device use serial."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor


class TorchWorker:
    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=name)

    async def run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
