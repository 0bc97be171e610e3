"""The consumer's checks of a ``Consumer.Transfer`` stream an outside tester found open (tiny models,
the real services): a header whose ``deadline_unix`` is not a finite unix time (NaN compares false
with everything, so the deadline check never fired), the header's other float fields, and frames
sent after the trailer (they were never read: the answer was OK). After every refusal the consumer
holds no slot and serves the next request. Every wait is a bounded poll; nothing asserts a timing."""

from __future__ import annotations

import time

import grpc
import pytest
from ops_common import MD, PROMPT, cons, idle, make_frames
from ops_support import wait_for

from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg


def outcome(svc, consumer, frames, timeout: float | None = 30):
    """(the events received, the call's error or None)."""
    got: list[pb.TokenEvent] = []
    with grpc.insecure_channel(svc.consumer_addresses[consumer]) as ch:
        try:
            for ev in pbg.ConsumerStub(ch).Transfer(iter(frames), timeout=timeout, metadata=MD):
                got.append(ev)
        except grpc.RpcError as e:
            return got, e
    return got, None


def refused(svc, consumer, frames):
    """The call's error and its in-band error event; no complete answer came before it."""
    got, err = outcome(svc, consumer, frames)
    assert err is not None, "the stream was answered"
    assert not any(ev.HasField("timings") for ev in got), "a complete answer came before the refusal"
    assert got and got[-1].HasField("error"), "no in-band status"
    return err, got[-1].error


def still_serves(svc, consumer="same"):
    """The consumer holds nothing and answers the next valid stream."""
    wait_for(lambda: idle(svc, consumer), what="the consumer to hold nothing")
    got, err = outcome(svc, consumer, make_frames(svc, consumer))
    assert err is None and got[-1].finish_reason and got[-1].HasField("timings"), err
    wait_for(lambda: idle(svc, consumer), what="the consumer to hold nothing")


# ---------------------------------------------------------------------------- the header's deadline
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1.0])
def test_a_header_deadline_that_is_not_a_finite_unix_time_is_refused(svc, value):
    err, inband = refused(svc, "same", make_frames(svc, "same", deadline_unix=value))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "deadline_unix" in err.details() and "finite unix time in seconds" in err.details(), err.details()
    assert inband.code == "INVALID_ARGUMENT" and inband.param == "deadline_unix"
    still_serves(svc)


@pytest.mark.parametrize("timeout", [30, None])
def test_a_far_future_header_deadline_does_not_pass_the_consumers_own(svc, monkeypatch, timeout):
    """1e300 is finite: served, but the consumer keeps its own deadline (the call's, or its own
    max_queue_wait_s + 4 x frame_timeout_s when the call has none)."""
    eng = cons(svc, "same").engine
    own_deadline, seen, transfer, decode = [], [], eng.transfer, eng._decode

    def spy_transfer(events, deadline, *args, **kw):
        own_deadline.append(deadline)
        return transfer(events, deadline, *args, **kw)

    def spy(req, deadline):
        seen.append(deadline)
        return decode(req, deadline)

    monkeypatch.setattr(eng, "transfer", spy_transfer)
    monkeypatch.setattr(eng, "_decode", spy)
    t0 = time.time()
    got, err = outcome(svc, "same", make_frames(svc, "same", deadline_unix=1e300), timeout=timeout)
    t1 = time.time()
    assert err is None and got[-1].HasField("timings"), err
    # The decoder runs under the consumer's own deadline, not the header's.
    assert len(seen) == 1 and len(own_deadline) == 1 and seen[0] == own_deadline[0], (seen, own_deadline)
    s = eng.settings
    own = timeout if timeout is not None else s.max_queue_wait_s + 4 * s.frame_timeout_s
    # gRPC sends a call's timeout rounded up (a 10-100 s one to 100 ms units: grpc-timeout "300" + "00m") and
    # keeps deadlines in milliseconds, so the consumer's may lie up to ~0.1 s past the client's (CI saw 0.09 s);
    # without a call timeout the consumer's own is exact.
    rounding = 0.102 if timeout is not None else 0.0
    assert t0 + own - 5 <= own_deadline[0] <= t1 + own + rounding, (own_deadline, t0, t1)
    wait_for(lambda: idle(svc, "same"), what="the consumer to hold nothing")


def test_a_zero_deadline_is_none_and_a_past_one_is_deadline_exceeded(svc):
    got, err = outcome(svc, "same", make_frames(svc, "same", deadline_unix=0.0))
    assert err is None and got[-1].HasField("timings"), err
    err, inband = refused(svc, "same", make_frames(svc, "same", deadline_unix=time.time() - 60))
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "deadline" in err.details(), err.details()
    still_serves(svc)


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("temperature", float("inf")),
                                         ("top_p", float("nan")), ("top_p", float("-inf"))])
def test_non_finite_sampling_floats_in_the_header_are_refused(svc, field, value):
    err, inband = refused(svc, "same", make_frames(svc, "same", sampling=pb.SamplingParams(max_new_tokens=2,
                                                                                           **{field: value})))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details(), err.details()
    assert inband.param == field
    still_serves(svc)


# ---------------------------------------------------------------------------- frames after the trailer
@pytest.mark.parametrize("extra", ["chunk", "trailer", "header", "empty", "many chunks"])
def test_a_frame_after_the_trailer_is_refused(svc, extra):
    frames = make_frames(svc, "same", max_new=8)
    after = {"chunk": [frames[1]], "trailer": [frames[-1]], "header": [frames[0]], "empty": [pb.KVFrame()],
             "many chunks": frames[1:-1] * 4}[extra]
    err, inband = refused(svc, "same", frames + after)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert "a frame arrived after the trailer" in err.details(), err.details()
    assert inband.code == "INVALID_ARGUMENT" and "after the trailer" in inband.message
    still_serves(svc)


def test_a_stream_left_open_after_its_trailer_is_bounded_by_the_frame_lease(svc):
    """The answer completes only once the stream has ended (so that a frame after the trailer is
    always seen); a sender that never closes its side holds the request no longer than a frame could."""
    import threading

    frames, release = make_frames(svc, "lease", max_new=4), threading.Event()

    def open_after_trailer():
        yield from frames
        release.wait(30)  # never closes its side (until the test is over)

    try:
        err, _ = refused(svc, "lease", open_after_trailer())
    finally:
        release.set()
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "did not end" in err.details(), err.details()
    still_serves(svc, "lease")


# ---------------------------------------------------------------------------- a header at odds with itself
@pytest.mark.parametrize("fields,says", [
    (dict(native_prefix=False, prefix_len=1000), "prefix_len=1000 with native_prefix=false"),
    (dict(native_prefix=True, prefix_len=1000), "prefix_len=1000 with native_prefix=true"),
    (dict(native_prefix=False, prefix_len=3), "prefix_len=3 with native_prefix=false"),
    (dict(n_tokens=5), "n_tokens=5"),
])
def test_a_header_inconsistent_with_itself_is_refused(svc, fields, says):
    """A prefix longer than the prompt, or declared without native_prefix, was accepted (issue 58)."""
    err, inband = refused(svc, "same", make_frames(svc, "same", **fields))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and says in err.details(), err.details()
    assert inband.code == "INVALID_ARGUMENT"
    still_serves(svc)


# ---------------------------------------------------------------------------- the producer's prefill
@pytest.mark.parametrize("allowance,served", [(200.0, True), (0.0, False)])
def test_the_wait_for_the_first_data_frame_allows_for_the_prefill(svc, monkeypatch, allowance, served):
    """The producer sends the header, then prefills: the first data frame came after frame_timeout_s
    on a busy producer with a long prompt, and the request failed with 'no frame for 30 s' (issue 58).
    Here the sender waits 3 s after its header, over the lease consumer's frame_timeout_s of 1.5 s:
    served with 200 ms per prompt token (40 tokens: 8 s more), cut without an allowance."""
    import threading

    eng = cons(svc, "lease").engine
    monkeypatch.setattr(eng, "settings", eng.settings.model_copy(update={"prefill_allowance_ms_per_token": allowance}))
    frames, release = make_frames(svc, "lease", max_new=2), threading.Event()

    def prefilling():
        yield frames[0]
        release.wait(3.0)  # "prefilling"
        yield from frames[1:]

    try:
        got, err = outcome(svc, "lease", prefilling())
    finally:
        release.set()
    if served:
        assert err is None and got[-1].HasField("timings"), err
    else:
        assert err is not None and err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
        assert "no frame for 1.5 s (frame_timeout_s)" in err.details(), err.details()
    still_serves(svc, "lease")


# ---------------------------------------------------------------------------- a sender still writing
def test_an_async_sender_still_writing_gets_the_status_not_a_transport_error(svc):
    """A grpc.aio client still writing its frames when the consumer refused the stream saw "INTERNAL:
    Internal error from Core" instead of the status (45 of 200 refused at the header, issue 58): the
    consumer now reads on until the sender stops (1 s at most) before it ends the call."""
    import asyncio

    refused_at_header = make_frames(svc, "same", prompt_ids=[9999] + PROMPT[1:])
    flipped = make_frames(svc, "same")
    flipped[2].chunk.crc32c ^= 1

    async def codes(frames, n=40):
        got = []
        async with grpc.aio.insecure_channel(svc.consumer_addresses["same"]) as ch:
            stub = pbg.ConsumerStub(ch)
            for _ in range(n):
                async def gen():
                    for f in frames:
                        yield f
                try:
                    async for _ in stub.Transfer(gen(), timeout=30, metadata=MD):
                        pass
                    got.append("answered")
                except grpc.aio.AioRpcError as e:
                    got.append(e.code().name)
        return got

    assert set(asyncio.run(codes(refused_at_header))) == {"INVALID_ARGUMENT"}
    assert set(asyncio.run(codes(flipped))) == {"DATA_LOSS"}
    still_serves(svc)
