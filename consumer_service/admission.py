"""Admission control on the consumer: at most ``max_concurrent`` requests hold a cache, their
estimated cache bytes stay within ``budget`` (0 = unbounded), at most ``max_queue`` wait (FIFO);
past that, ``ResourceExhausted``. Every grant is released exactly once, on every exit path."""

from __future__ import annotations

import asyncio
import collections
import contextlib

from shared.errors import InvalidRequest, ResourceExhausted
from shared.metrics import Metrics


class AdmissionController:
    def __init__(self, max_concurrent: int, max_queue: int, budget: int = 0, metrics: Metrics | None = None):
        self.max_concurrent, self.max_queue, self.budget = max_concurrent, max_queue, budget
        self.metrics = metrics
        self.active = 0
        self.held = 0  # estimated bytes of admitted requests
        self.peak_held = 0
        self.peak_active = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        if metrics is not None:
            metrics.cache_budget.set(budget)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def _fits(self, nbytes: int) -> bool:
        return self.active < self.max_concurrent and (not self.budget or self.held + nbytes <= self.budget)

    def _grant(self, nbytes: int) -> None:
        self.active += 1
        self.held += nbytes
        self.peak_held = max(self.peak_held, self.held)
        self.peak_active = max(self.peak_active, self.active)
        self._publish()

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.inflight.set(self.active)
            self.metrics.cache_bytes.set(self.held)
            self.metrics.queue.set(len(self._waiters))

    def _release(self, nbytes: int) -> None:
        self.active -= 1
        self.held -= nbytes
        self._wake()
        self._publish()

    def _wake(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            nbytes, fut = self._waiters.popleft()
            if fut.done():  # cancelled while waiting
                continue
            self._grant(nbytes)
            fut.set_result(None)

    async def acquire(self, nbytes: int, timeout: float) -> None:
        if self.budget and nbytes > self.budget:  # never fits, however long it waits: not a retry-later 429
            raise InvalidRequest(
                f"request needs an estimated {nbytes:,} bytes of cache; the consumer's budget is {self.budget:,}: "
                "send a shorter prompt or fewer max_new_tokens, or raise cache_budget_bytes")
        if not self._waiters and self._fits(nbytes):
            self._grant(nbytes)
            return
        if len(self._waiters) >= self.max_queue:
            raise ResourceExhausted(
                f"consumer at capacity ({self.active} requests, {self.held:,} of {self.budget or 'unbounded'} cache "
                f"bytes, {len(self._waiters)} queued): retry later or add consumer replicas")
        fut = asyncio.get_running_loop().create_future()
        entry = (nbytes, fut)
        self._waiters.append(entry)
        self._publish()
        try:
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        except BaseException as e:
            if fut.done() and not fut.cancelled():  # granted at the last moment: give it back
                self._release(nbytes)
            else:
                fut.cancel()
                with contextlib.suppress(ValueError):
                    self._waiters.remove(entry)
                self._wake()
                self._publish()
            if isinstance(e, asyncio.TimeoutError):
                raise ResourceExhausted(f"waited {timeout:.1f} s for admission; the consumer is at capacity: retry "
                                        "later or add consumer replicas") from None
            raise

    @contextlib.asynccontextmanager
    async def slot(self, nbytes: int, timeout: float):
        await self.acquire(nbytes, timeout)
        try:
            yield
        finally:
            self._release(nbytes)
