"""Reconstruction overlaps the transfer: on a slow link (frames sent with a pause between layers),
the consumer has rebuilt its first layers before the last frame is even sent. The consumer engine
reads frames ahead of reconstruction through a bounded queue, so this holds whatever HTTP/2 flow
control does; with the benchmark hold (``bench.hold_layers`` and its metadata) it does not."""

import threading
import time

import grpc
import pytest

from consumer_service.engine import ConsumerEngine
from consumer_service.settings import ConsumerSettings
from shared.codecs import CodecContext, make_method
from shared.config import BENCH_HOLD_METADATA
from shared.model.hf_adapter import ModelAdapter
from shared.model.tiny import tiny_model
from shared.rpc import scd_pb2_grpc as pbg
from shared.rpc.server import OPTIONS
from shared.rpc.wire import PROTOCOL_VERSION, StreamTotals, header_frame, layer_frames
from tools.inprocess import InProcessServices

N_LAYERS, PAUSE_S = 6, 0.25
PROMPT = list(range(3, 60))


def _stream(model: ModelAdapter) -> list[list]:
    """Per layer, its frames (raw fp32); the header first, the trailer last."""
    from shared.domain import SamplingRequest, StreamHeader

    enc = make_method("raw", CodecContext(model), {"dtype": "float32"})
    state = model.prefill(PROMPT[:-1])
    totals = StreamTotals()
    h = StreamHeader(request_id="r", method="raw", method_version=1, protocol_version=PROTOCOL_VERSION,
                     pair_fingerprint=f"{'0' * 16}:raw", n_layers=model.n_layers, n_tokens=len(PROMPT) - 1,
                     prompt_ids=tuple(PROMPT), params=enc.cfg.wire_params(), sampling=SamplingRequest(max_new_tokens=2),
                     native_prefix=False, prefix_len=0, consumer="c", deadline_unix=time.time() + 60)
    groups = [[totals.add(header_frame(h))]]
    for layer in range(model.n_layers):
        groups.append([totals.add(f) for f in layer_frames(layer, enc.encode_layer(state, layer, 0))])
    groups.append([totals.trailer()])
    return groups


@pytest.mark.parametrize("hold", [False, True], ids=["pipelined", "bench-hold"])
def test_early_layers_are_rebuilt_before_the_last_frame_arrives(hold, monkeypatch):
    model = tiny_model("llama", n_layers=N_LAYERS)
    s = ConsumerSettings.load(model={"path": "-"}, server={"port": 0}, name="c", methods=["raw"],
                              bench={"hold_layers": True})
    engine = ConsumerEngine(s, model)
    done: dict[int, float] = {}
    add = engine.add_layer

    def timed_add(req, layer, tensors):
        add(req, layer, tensors)
        done[layer] = time.monotonic()

    monkeypatch.setattr(engine, "add_layer", timed_add)
    groups = _stream(ModelAdapter(model))
    sent: dict[str, float] = {}

    def frames():
        for i, group in enumerate(groups):
            if i >= 2:  # a slow link: each layer after the first arrives PAUSE_S after the previous one
                time.sleep(PAUSE_S)
            if i == len(groups) - 1:
                sent["last"] = time.monotonic()
            yield from group

    with InProcessServices([engine], None) as svc:
        address = svc.consumer_addresses["c"]
        md = ((BENCH_HOLD_METADATA, "1"),) if hold else ()
        result: dict = {}

        def call():
            with grpc.insecure_channel(address, options=OPTIONS) as ch:
                result["events"] = list(pbg.ConsumerStub(ch).Transfer(frames(), timeout=60, metadata=md or None))

        t = threading.Thread(target=call)
        t.start()
        t.join(60)
    assert len(result["events"]) == 2 and result["events"][-1].timings.transfer_ms > PAUSE_S * 1e3
    assert sorted(done) == list(range(N_LAYERS))
    if hold:
        assert min(done.values()) > sent["last"], "with the benchmark hold nothing is rebuilt before the trailer"
    else:
        early = [layer for layer, t_done in done.items() if t_done < sent["last"]]
        assert early[: N_LAYERS - 1] == list(range(N_LAYERS - 1)), (done, sent)

