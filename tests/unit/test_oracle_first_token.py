"""The Oracle serves its first token from its own prefill of the whole prompt (one pass, as an engine
serving the prompt alone would); every transfer method's first step feeds the prompt's last token."""

import torch

from shared.codecs import CodecContext, DecodeJob, make_method
from shared.generation import Generator, Sampling
from shared.model.hf_adapter import clone_cache

IDS = torch.randint(0, 256, (33,), generator=torch.Generator().manual_seed(5)).tolist()


class Counting:
    """The adapter, counting the forward passes a generator asks of it."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def forward_with_cache(self, cache, ids):
        self.calls += 1
        return self.model.forward_with_cache(cache, ids)


def _greedy(model, cache, logits, n=6):
    counting = Counting(model)
    g = Generator(counting, cache, IDS[-1], Sampling(max_new_tokens=n), None, first_logits=logits)
    while not g.finished:
        g.step()
    return g.tokens, counting.calls


def test_the_oracle_first_token_comes_with_its_prefill(tiny_pair):
    _, consumer = tiny_pair
    job = DecodeJob(prompt_ids=IDS, n_tokens=len(IDS) - 1, start=0)
    cache, logits = make_method("oracle", CodecContext(consumer)).start(job).finish_for_decoding()
    assert cache.get_seq_length() == len(IDS) and logits.shape == (consumer.config.vocab_size,)
    stepped = consumer.own_cache(IDS[:-1])  # the path a transfer takes: all but the last token, then a step
    torch.testing.assert_close(logits, consumer.forward_with_cache(clone_cache(stepped), [IDS[-1]])[0, -1],
                               atol=1e-4, rtol=1e-4)
    tokens, calls = _greedy(consumer, cache, logits)
    want, want_calls = _greedy(consumer, stepped, None)
    assert tokens == want and len(tokens) == 6
    assert (calls, want_calls) == (5, 6)  # the first token ran no forward pass


def test_a_transfer_decodes_from_the_last_prompt_token(tiny_pair):
    producer, consumer = tiny_pair
    raw = make_method("raw", CodecContext(consumer), {"dtype": "float32"})
    session = raw.start(DecodeJob(prompt_ids=IDS, n_tokens=len(IDS) - 1, start=0))
    state = producer.prefill(IDS[:-1])
    encoder = make_method("raw", CodecContext(producer), {"dtype": "float32"})
    for layer in range(producer.n_layers):
        session.add_layer(layer, encoder.encode_layer(state, layer, 0))
    cache, logits = session.finish_for_decoding()
    assert logits is None and cache.get_seq_length() == len(IDS) - 1
