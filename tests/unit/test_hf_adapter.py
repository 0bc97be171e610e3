"""The adapter's paths are exact where they must be, on tiny models of every supported family."""

import pytest
import torch

from shared.model.hf_adapter import ModelAdapter, UnsupportedModel, clone_cache
from shared.model.sparse import CHUNKED_SDPA, SparseLayers
from shared.model.tiny import FAMILIES, perturbed, tiny_model

IDS = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(3))


# every family, and the sliding-window variants (a window of 16 over 37-token prompts really slides)
VARIANTS = [(f, None) for f in FAMILIES] + [("mistral", 16), ("qwen2", 16), ("gemma2", 16)]


@pytest.fixture(params=VARIANTS, ids=[f"{f}-sw{w}" if w else f for f, w in VARIANTS])
def adapter(request):
    family, window = request.param
    return ModelAdapter(tiny_model(family, sliding_window=window))


def test_rebuilt_own_cache_decodes_identically(adapter):
    prompt = IDS[0].tolist()
    state = adapter.prefill(prompt[:-1])
    rebuilt = adapter.build_cache(state.keys, state.values)
    native = adapter.own_cache(prompt[:-1])
    assert rebuilt.get_seq_length() == native.get_seq_length() == len(prompt) - 1
    for layer in range(adapter.n_layers):
        kr, vr = ModelAdapter.cache_kv(rebuilt, layer)
        kn, vn = ModelAdapter.cache_kv(native, layer)
        torch.testing.assert_close(kr, kn, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(vr, vn, atol=0, rtol=0)
    got = adapter.greedy(rebuilt, prompt[-1], 12)
    ref = list(prompt)  # greedy by full forwards, no cache at all (generate() drifts on Gemma 2's window)
    with torch.no_grad():
        for _ in range(12):
            ref.append(int(adapter.model(input_ids=torch.tensor([ref])).logits[0, -1].argmax()))
    assert got == ref[len(prompt):], f"expected {ref[len(prompt):]}, got {got}"


def test_regenerated_layer_equals_cached_kv(adapter):
    layers = list(range(adapter.n_layers))
    state = adapter.prefill(IDS, hidden_layers=layers)
    for layer in layers:
        k, v = adapter.regenerate_kv(layer, state.hidden[layer])
        torch.testing.assert_close(k, state.keys[layer], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(v, state.values[layer], atol=1e-6, rtol=1e-6)


def test_run_layers_reproduces_prefill(adapter):
    n = adapter.n_layers
    state = adapter.prefill(IDS, residual_layers=[1, n - 1])
    out, keys, values = adapter.run_layers(state.residual[1], 1, n - 1)
    torch.testing.assert_close(out, state.residual[n - 1], atol=1e-5, rtol=1e-5)
    for j, layer in enumerate(range(1, n - 1)):
        torch.testing.assert_close(keys[j], state.keys[layer], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[j], state.values[layer], atol=1e-5, rtol=1e-5)


def test_sparse_run_recomputes_its_positions_exactly(adapter):
    """Selected positions recomputed over the others' true K/V give the prefill's own states and
    K/V there, whatever the family (sliding windows included); every position selected ignores the
    K/V it is given; and the given K/V really are what the other positions contribute."""
    n = adapter.n_layers
    state = adapter.prefill(IDS, residual_layers=[1, n - 1])
    true_k, true_v = list(state.keys[1:n - 1]), list(state.values[1:n - 1])
    junk_k = [torch.randn_like(k) for k in true_k]
    junk_v = [torch.randn_like(v) for v in true_v]
    sel = torch.tensor([0, 4, 17, 30, 36])
    out, keys, values = adapter.run_layers_sparse(state.residual[1][:, sel], sel, true_k, true_v, 1, n - 1)
    torch.testing.assert_close(out, state.residual[n - 1][:, sel], atol=1e-5, rtol=1e-5)
    for j in range(n - 2):
        torch.testing.assert_close(keys[j], true_k[j], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values[j], true_v[j], atol=1e-5, rtol=1e-5)
    every = torch.arange(IDS.shape[1])
    out, keys, _ = adapter.run_layers_sparse(state.residual[1], every, junk_k, junk_v, 1, n - 1)
    torch.testing.assert_close(out, state.residual[n - 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(keys[-1], true_k[-1], atol=1e-5, rtol=1e-5)
    out, keys, _ = adapter.run_layers_sparse(state.residual[1][:, sel], sel, junk_k, junk_v, 1, n - 1)
    assert not torch.allclose(out, state.residual[n - 1][:, sel], atol=1e-3)
    others = torch.ones(IDS.shape[1], dtype=torch.bool)
    others[sel] = False
    assert torch.equal(keys[0][:, :, others], junk_k[0][:, :, others])  # the given K/V kept as given


def test_sparse_run_attends_in_query_chunks_exactly(adapter, monkeypatch):
    """With the adapter's attention (transformers' sdpa, which it sets on a model that uses sdpa), a
    sparse run attends in chunks of its positions, each chunk over the keys up to its last position
    only, and still gives the prefill's own states."""
    monkeypatch.setattr(SparseLayers, "min_chunk_positions", 2)
    n = adapter.n_layers
    state = adapter.prefill(IDS, residual_layers=[1, n - 1])
    sel = torch.tensor([0, 3, 4, 9, 17, 18, 25, 30, 33, 36])
    assert [c[:3] for c in SparseLayers(adapter, sel, IDS.shape[1]).chunks["full_attention"]] == [
        (0, 2, 4), (2, 5, 18), (5, 7, 26), (7, 10, 37)]
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        calls.append((q.shape[2], k.shape[2]))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    ks, vs = list(state.keys[1:n - 1]), list(state.values[1:n - 1])
    out, _, _ = adapter.run_layers_sparse(state.residual[1][:, sel], sel, ks, vs, 1, n - 1)
    torch.testing.assert_close(out, state.residual[n - 1][:, sel], atol=1e-5, rtol=1e-5)
    if adapter.config._attn_implementation == CHUNKED_SDPA:
        assert calls == [(2, 4), (3, 18), (2, 26), (3, 37)] * (n - 2)
    else:  # eager attention (gemma2's soft-capping): one call over every key, no chunks
        assert adapter.config._attn_implementation == "eager" and calls == []


def test_attention_mass_is_what_the_tail_attends_to(adapter):
    """Softmax rows: the mass sums to queries x heads; causal: a query never attends ahead, so the
    last position gets attention only from the last query."""
    state = adapter.prefill(IDS, residual_layers=[1])
    h = state.residual[1]
    n_heads = adapter.model.config.num_attention_heads
    mass = adapter.attention_mass(1, h, 8)
    assert mass.shape == (IDS.shape[1],) and bool((mass >= 0).all())
    assert float(mass.sum()) == pytest.approx(8 * n_heads, rel=1e-4)
    last_only = adapter.attention_mass(1, h, 1)
    assert float(last_only.sum()) == pytest.approx(n_heads, rel=1e-4)
    assert float(mass[-1]) == pytest.approx(float(last_only[-1]), rel=1e-4)


def test_score_matches_full_forward(adapter):
    prompt, cont = IDS[0, :30].tolist(), IDS[0, 30:].tolist()
    state = adapter.prefill(prompt[:-1])
    lp = adapter.score(adapter.build_cache(state.keys, state.values), prompt[-1], cont)
    full = torch.log_softmax(adapter.model(input_ids=IDS).logits[0, 29:].float(), -1)
    torch.testing.assert_close(lp, full, atol=1e-4, rtol=1e-4)


def test_cross_model_cache_differs_but_has_right_shape():
    a, b = ModelAdapter(tiny_model("llama")), ModelAdapter(perturbed(tiny_model("llama"), 0.2))
    sa, sb = a.prefill(IDS), b.prefill(IDS)
    assert sa.keys[0].shape == sb.keys[0].shape == (1, 2, 37, 16)
    assert not torch.allclose(sa.values[-1], sb.values[-1])


def test_clone_cache_is_independent(adapter):
    c = adapter.own_cache(IDS)
    d = clone_cache(c, adapter.config)
    adapter.forward_with_cache(d, [1])
    assert c.get_seq_length() == 37 and d.get_seq_length() == 38
    # the clone decodes like the original (a sliding layer keeps its position count)
    e = clone_cache(c)
    torch.testing.assert_close(adapter.forward_with_cache(e, [1]), adapter.forward_with_cache(c, [1]))


def test_qwen3_keys_include_the_key_norm():
    a = ModelAdapter(tiny_model("qwen3"))
    attn = a.layers[0].self_attn
    with torch.no_grad():
        attn.k_norm.weight.mul_(3.0)  # a key norm that is not the identity
    layers = list(range(a.n_layers))
    state = a.prefill(IDS, hidden_layers=layers)
    k, _ = a.regenerate_kv(0, state.hidden[0])
    torch.testing.assert_close(state.keys[0], k, atol=1e-6, rtol=1e-6)
    with torch.inference_mode():
        plain = attn.k_proj(state.hidden[0]).view(1, 37, 2, 16).transpose(1, 2)
    assert not torch.allclose(state.keys[0], plain)


@pytest.mark.parametrize("model_type,why", [("gemma3_text", "RoPE"), ("gpt2", "k_proj"),
                                            ("smollm3", "no_rope_layers"), ("olmo2", "post-norm"),
                                            ("bert", "supported families")])
def test_unsupported_family_refused(model_type, why):
    from shared.model.hf_adapter import check_supported

    with pytest.raises(UnsupportedModel, match=why) as e:
        check_supported(model_type)
    assert "llama" in str(e.value) and "qwen3" in str(e.value)



def test_capture_ignores_another_threads_forward_on_the_same_model():
    """One model may serve two engines in one process (a producer and a consumer of the same
    weights, each with its own worker thread): a forward pass on another thread while this one
    captures K/V must not land in this one's capture (it did: a 1-token decode step's K replaced
    the prompt's, and the consumer refused the stream)."""
    import threading

    adapter = ModelAdapter(tiny_model("llama"))
    prompt = IDS[0].tolist()
    positions = torch.arange(len(prompt) - 6, len(prompt))

    def captures():
        state = adapter.prefill(prompt, hidden_layers=[1], residual_layers=[1])
        sparse = adapter.run_layers_sparse(state.residual[1][:, positions], positions, state.keys[1:], state.values[1:],
                                           1, adapter.n_layers)
        return state, sparse

    want = captures()

    me = threading.get_ident()

    def another_threads_forward(_mod, _inp, _out):  # the other thread runs a whole 1-token forward pass
        if threading.get_ident() != me:
            return
        t = threading.Thread(target=lambda: adapter.model(input_ids=torch.tensor([prompt[:1]])))
        t.start()
        t.join()

    # after the prefill has captured every layer, and inside each sparse layer after its key capture
    hooks = [adapter.layers[-1].register_forward_hook(another_threads_forward)]
    hooks += [layer.self_attn.v_proj.register_forward_hook(another_threads_forward) for layer in adapter.layers]
    try:
        got = captures()
    finally:
        for h in hooks:
            h.remove()
    for layer in range(adapter.n_layers):
        assert got[0].keys[layer].shape[2] == len(prompt), f"layer {layer}: {got[0].keys[layer].shape[2]} positions"
        torch.testing.assert_close(got[0].keys[layer], want[0].keys[layer], atol=0, rtol=0)
        torch.testing.assert_close(got[0].values[layer], want[0].values[layer], atol=0, rtol=0)
    torch.testing.assert_close(got[0].hidden[1], want[0].hidden[1], atol=0, rtol=0)
    torch.testing.assert_close(got[0].residual[1], want[0].residual[1], atol=0, rtol=0)
    for a, b in zip(got[1][1] + got[1][2], want[1][1] + want[1][2]):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
