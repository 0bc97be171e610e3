"""Stop strings: the answer ends before the first one, and no part of one is ever streamed, even
when it spans tokens (text that may begin a stop string is held back until it is known)."""

from __future__ import annotations

import pytest
import torch

from shared.generation import Generator, Sampling

PIECES = [" ", "5", ",", " ", "6", ",", " 7", ",", " 8"]


class ScriptedModel:
    """Greedy decoding yields token i at step i (its logits are one-hot)."""

    def __init__(self):
        self.step = 0

    def forward_with_cache(self, cache, ids):
        logits = torch.full((1, 1, len(PIECES)), -1e9)
        logits[0, 0, self.step] = 0.0
        self.step += 1
        return logits


class PieceTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(PIECES[i] for i in ids)


def run(stop, max_new=len(PIECES)):
    g = Generator(ScriptedModel(), cache=None, next_id=0, tokenizer=PieceTokenizer(),
                  sampling=Sampling(max_new_tokens=max_new, stop=tuple(stop)))
    deltas, finish = [], ""
    while not g.finished:
        step = g.step()
        deltas.append(step.text)
        finish = step.finish_reason
    return deltas, finish


@pytest.mark.parametrize("stop,text", [
    ([", 6"], " 5"),  # spans three tokens
    (["5"], " "),
    ([", 8", ", 6"], " 5"),  # the earliest of several
    ([" 7,"], " 5, 6,"),
])
def test_the_answer_ends_before_the_stop_string_and_none_of_it_is_streamed(stop, text):
    deltas, finish = run(stop)
    assert "".join(deltas) == text and finish == "stop", deltas


def test_text_held_back_as_a_possible_stop_is_sent_once_it_is_not_one():
    deltas, finish = run([", 9"])  # ", " and "," begin it, then the text goes elsewhere
    assert "".join(deltas) == "".join(PIECES) and finish == "length", deltas
    deltas, finish = run([", 6!"], max_new=5)  # the answer ends (length) while ", 6" still might begin it
    assert "".join(deltas) == " 5, 6" and finish == "length", deltas
