"""Every registered transfer method honours the same contract (parametrised over CODECS)."""

from typing import get_args

import pytest
import torch

from shared.artifacts import store
from shared.codecs import CODECS, CodecConfig, CodecContext, DecodeJob, make_method
from shared.codecs.scd import PairArtifacts
from shared.rpc import scd_pb2 as pb
from shared.rpc.wire import FrameDecoder, StreamTotals, layer_frames

IDS = torch.randint(0, 256, (161,), generator=torch.Generator().manual_seed(9)).tolist()


def test_registry_keys_match_config_union():
    members = get_args(get_args(CodecConfig)[0])
    assert {m.model_fields["kind"].default for m in members} == set(CODECS)


@pytest.fixture(scope="module")
def contexts(tiny_pair, tiny_artifacts, tiny_droidspeak):
    producer, consumer = tiny_pair
    folder, _ = tiny_artifacts
    meta, pt = store.load(folder, "producer")
    _, ct = store.load(folder, "consumer")
    return (CodecContext(producer, PairArtifacts(meta, pt, "producer"), {"droidspeak": tiny_droidspeak}),
            CodecContext(consumer, PairArtifacts(meta, ct, "consumer"), {"droidspeak": tiny_droidspeak}))


def _transfer(kind, pctx, cctx, start=0, params=None):
    """encode every layer -> frames -> decoder -> decode; returns (cache, payload bytes, encoded)."""
    enc, dec = make_method(kind, pctx, params), make_method(kind, cctx, params)
    state = pctx.model.prefill(IDS[:-1], hidden_layers=enc.hidden_layers(), residual_layers=enc.residual_layers())
    own = cctx.model.prefill(IDS[:-1])
    job = DecodeJob(IDS, len(IDS) - 1, start, tuple(k[:, :, :start] for k in own.keys),
                    tuple(v[:, :, :start] for v in own.values))
    session = dec.start(job)
    totals, fd = StreamTotals(), FrameDecoder(n_layers=pctx.model.n_layers)
    fd.feed(pb.KVFrame(header=pb.Header(n_layers=pctx.model.n_layers)))
    encoded = []
    if enc.transfers_layers:
        for layer in range(pctx.model.n_layers):
            tensors = enc.encode_layer(state, layer, start)
            encoded.append(tensors)
            for f in layer_frames(layer, tensors):
                out = fd.feed(totals.add(f))
            assert out[0] == "layer"
            got = out[1][1]
            assert {k: (v.dtype, v.shape) for k, v in got.items()} == {k: (v.dtype, v.shape) for k, v in tensors.items()}
            session.add_layer(layer, got)
    fd.feed(totals.trailer())
    return session.finish(), totals.payload_bytes, encoded


@pytest.mark.parametrize("kind", sorted(CODECS))
def test_round_trip_shapes_dtypes_and_determinism(kind, contexts):
    pctx, cctx = contexts
    cache, _, enc1 = _transfer(kind, pctx, cctx)
    m = cctx.model
    for layer in range(m.n_layers):
        k, v = cache.layers[layer].keys, cache.layers[layer].values
        assert k.shape == v.shape == (1, m.n_kv_heads, len(IDS) - 1, m.head_dim)
        assert k.dtype == v.dtype == m.dtype
    _, _, enc2 = _transfer(kind, pctx, cctx)
    for a, b in zip(enc1, enc2):
        assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("kind", sorted(k for k, c in CODECS.items() if not c.cross_model))
def test_same_model_methods_are_exact_or_within_bound(kind, contexts):
    pctx, _ = contexts
    same = CodecContext(pctx.model)
    for params in ({}, {"dtype": "float32"}) if kind == "raw" else ({},):
        method = make_method(kind, same, params)
        cache, _, _ = _transfer(kind, same, same, params=params)
        native = same.model.own_cache(IDS[:-1])
        for layer in range(same.model.n_layers):
            for got, ref in ((cache.layers[layer].keys, native.layers[layer].keys),
                             (cache.layers[layer].values, native.layers[layer].values)):
                err = float((got - ref).norm() / ref.norm())
                if method.lossless:
                    assert err < 1e-5, f"{kind}{params} layer {layer}: lossless but rel err {err}"
                else:
                    assert err <= method.error_bound(), f"{kind}{params} layer {layer}: {err} > {method.error_bound()}"


@pytest.mark.parametrize("kind", sorted(k for k, c in CODECS.items() if c.cross_model))
def test_cross_model_methods_beat_raw_against_the_consumers_own_cache(kind, contexts):
    pctx, cctx = contexts
    cache, _, _ = _transfer(kind, pctx, cctx)
    raw, _, _ = _transfer("raw", pctx, cctx, params={"dtype": "float32"})
    native = cctx.model.own_cache(IDS[:-1])

    def err(c):  # over the layers the tiny pair's planted change (layer 2) drifts; 0-1 are identical
        return sum(float((c.layers[l].values - native.layers[l].values).norm() / native.layers[l].values.norm())
                   for l in range(2, cctx.model.n_layers))

    assert err(cache) < err(raw), (err(cache), err(raw))


@pytest.mark.parametrize("kind", sorted(k for k, c in CODECS.items() if c.compressive))
def test_compressive_methods_send_fewer_bytes_than_raw(kind, contexts):
    pctx, cctx = contexts
    _, nbytes, _ = _transfer(kind, pctx, cctx)
    _, raw_bytes, _ = _transfer("raw", pctx, cctx)
    assert nbytes < raw_bytes, (nbytes, raw_bytes)


@pytest.mark.parametrize("kind", sorted(CODECS))
def test_native_prefix_splices_the_consumers_own_kv(kind, contexts):
    pctx, cctx = contexts
    cache, _, _ = _transfer(kind, pctx, cctx, start=5)
    own = cctx.model.build_cache(*(lambda s: (s.keys, s.values))(cctx.model.prefill(IDS[:-1])))
    for layer in range(cctx.model.n_layers):
        torch.testing.assert_close(cache.layers[layer].values[:, :, :5], own.layers[layer].values[:, :, :5])


def test_wrong_method_version_and_fingerprint_are_refused(tiny_pair):
    from consumer_service.engine import ConsumerEngine
    from consumer_service.settings import ConsumerSettings
    from shared.errors import FingerprintMismatch, PreconditionFailed
    from shared.rpc.wire import PROTOCOL_VERSION

    _, consumer = tiny_pair
    eng = ConsumerEngine(ConsumerSettings.load(model={"path": "-"}, producer_fingerprint="abc", methods=["raw"]), consumer.model)
    h = pb.Header(method="raw", method_version=1, protocol_version=PROTOCOL_VERSION, pair_fingerprint="abc:raw",
                  n_layers=consumer.n_layers, n_tokens=len(IDS) - 1, prompt_ids=IDS)
    eng.open(h)
    for field, value, exc, says in (("method_version", 99, PreconditionFailed, "update the consumer"),
                                    ("protocol_version", 99, PreconditionFailed, "update the consumer"),
                                    ("pair_fingerprint", "zzz:raw", FingerprintMismatch, "recalibrate")):
        bad = pb.Header()
        bad.CopyFrom(h)
        setattr(bad, field, value)
        with pytest.raises(exc, match=says):
            eng.open(bad)
    eng.close()


def test_droidspeak_profile_recomputes_the_planted_layer(tiny_droidspeak):
    (a, b), = tiny_droidspeak["blocks"]
    assert a <= 2 < b and tiny_droidspeak["report"]["kl"] < tiny_droidspeak["report"]["raw_kl"]


def test_droidspeak_recompute_is_exact_between_identical_models(contexts):
    """Same model both sides: the recomputed block equals the native cache (fp16 on the wire)."""
    pctx, _ = contexts
    same = CodecContext(pctx.model)
    cache, nbytes, _ = _transfer("droidspeak", same, same, params={"blocks": "1-3"})
    native = same.model.own_cache(IDS[:-1])
    for layer in (1, 2):
        err = float((cache.layers[layer].values - native.layers[layer].values).norm() / native.layers[layer].values.norm())
        assert err < 5e-3, err
