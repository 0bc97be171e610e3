"""``oracle``: only token ids cross the wire; the consumer prefills the prompt itself.

The quality ceiling and the TTFT to beat."""

from __future__ import annotations

from typing import Literal

from shared.codecs.base import DecodeSession, MethodConfig, TransferMethod
from shared.errors import InvalidPayload


class OracleSession(DecodeSession):
    def decode_layer(self, layer, tensors):
        raise InvalidPayload("the oracle transfers no layers: only the token ids cross")

    def finish(self):
        return self.model.own_cache(self.job.prompt_ids[: self.job.n_tokens])

    def finish_for_decoding(self):
        """The whole prompt in one prefill, as an engine serving it alone computes it: the first token's
        logits come with the last position (a separate step for the last token, as a transfer needs,
        would read every weight once more: ~3% of this TTFT at 1,000 tokens on CPU)."""
        return self.model.own_prefill(self.job.prompt_ids)


class Oracle(TransferMethod, kind="oracle", lossless=True, transfers_layers=False):

    class Config(MethodConfig):
        kind: Literal["oracle"] = "oracle"

    Session = OracleSession

    def encode_layer(self, state, layer, start):
        return {}

    def schema(self, layer, job):
        return {}  # no layer crosses
