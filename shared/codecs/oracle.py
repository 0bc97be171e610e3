"""``oracle``: only token ids cross the wire; the consumer prefills the prompt itself.

The quality ceiling and the TTFT to beat."""

from __future__ import annotations

from typing import ClassVar, Literal

from shared.codecs.base import DecodeSession, MethodConfig, TransferMethod


class OracleSession(DecodeSession):
    def finish(self):
        return self.model.own_cache(self.job.prompt_ids[: self.job.n_tokens])


class Oracle(TransferMethod):
    kind: ClassVar[str] = "oracle"
    lossless: ClassVar[bool] = True
    transfers_layers: ClassVar[bool] = False

    class Config(MethodConfig):
        kind: Literal["oracle"] = "oracle"

    Session = OracleSession

    def encode_layer(self, state, layer, start):
        return {}
