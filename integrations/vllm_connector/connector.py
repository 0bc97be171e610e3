"""``SCDConnector``: the project's transfer methods as a vLLM V1 KV connector, for both roles.

Load it into an engine with::

    --kv-transfer-config '{"kv_connector": "SCDConnector", "kv_role": "kv_producer" | "kv_consumer",
                           "kv_connector_module_path": "integrations.vllm_connector.connector",
                           "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {...}}'

Producer role (the base model's engine), ``kv_connector_extra_config``: ``consumer`` (``host:port`` of
the consumer engine's receiver) and/or ``consumers`` (name -> ``host:port``: a request picks one with
``kv_transfer_params: {"scd_consumer": NAME}``, and its method with ``scd_method`` / ``scd_method_params``),
``method`` (``raw``, ``quant`` or ``scd-reuse``), ``method_params``
(strings, as ``method_params`` of the services), ``artifacts`` (the pair's folder in the artifact
store, for ``scd-reuse``), ``timeout_s``. Each prompt of at least one full block is transferred as the
engine prefills it: ``save_kv_layer`` reads the layer's K/V of the prompt's full blocks from the paged
cache, strips RoPE, encodes with the registered method and sends its frames while the next layer runs;
``wait_for_save`` sends the trailer and waits for the receiver's verdict.

Consumer role (the fine-tune's engine): ``listen`` (the receiver's ``host:port``), ``methods``,
``artifacts``, ``producer_fingerprint`` (optional; else the artifacts' own), ``max_held_bytes``,
``ttl_s``, ``frame_timeout_s`` (``settings.py``: every key is checked at start). The worker runs the
receiver (``transfers.Receiver``); the scheduler asks it (``Lookup``) for the longest block-aligned
prefix of a new prompt it holds and reports those tokens as already computed; the forward pass waits
per layer (``wait_for_layer_load``) for that layer's decoded K/V and writes them into the paged
cache: the transfer overlaps the consumer's forward. A transfer that fails (a checksum, a refused
header, a timeout) reports its blocks (``get_block_ids_with_load_errors``), and with
``kv_load_failure_policy: recompute`` vLLM recomputes them; the step's output for that request is
discarded, so no token ever comes from a bad cache.

Both roles write their counters to ``stats_file`` (JSON) when it is set. One worker per engine
(tensor parallelism 1) and prefills in one step (no chunked prefill of a transferred prompt).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import grpc
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.logger import init_logger

from integrations.vllm_connector import paged
from integrations.vllm_connector.engine_model import EngineModel
from integrations.vllm_connector.settings import ConsumerExtra, ProducerExtra, parse_extra
from integrations.vllm_connector.transfers import (
    AddressDoctor,
    Outgoing,
    Receiver,
    TransferFailed,
    check_method,
    make_header,
    prompt_key,
    serve_receiver,
)
from shared.codecs import CodecContext, make_method, resolve_variant
from shared.errors import SCDError, UnknownMethod
from shared.model.hf_adapter import ModelAdapter
from shared.rpc import scd_pb2 as pb
from shared.rpc import scd_pb2_grpc as pbg

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

log = init_logger(__name__)  # vLLM's logging: the connector's lines appear with the engine's
LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class LoadSpec:
    req_id: str
    key: str
    first: int  # the first position to write (earlier ones the engine computed or cached itself)
    n_tokens: int  # positions the transfer carries
    block_ids: list[int]


@dataclass
class SaveSpec:
    req_id: str
    key: str
    token_ids: list[int]  # the transferred positions and the next token
    block_ids: list[int]
    method: str = ""  # a request's own choice (kv_transfer_params scd_method), else the engine's
    params: dict[str, str] = field(default_factory=dict)
    consumer: str = ""  # a request's destination (kv_transfer_params scd_consumer: a name in `consumers`)


@dataclass
class SCDMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


def _slots(block_ids: list[int], first: int, last: int, block_size: int) -> torch.Tensor:
    pos = torch.arange(first, last)
    return torch.tensor(block_ids, dtype=torch.int64)[pos // block_size] * block_size + pos % block_size


def _artifacts(folder: str | None, side: str, producer_fp: str | None, own_fp: str):
    """One side of a pair's calibration artifacts, checked against the models' fingerprints."""
    if not folder:
        return None
    from shared.artifacts import store
    from shared.codecs.scd import PairArtifacts

    pfp, cfp = (own_fp, None) if side == "producer" else (producer_fp, own_fp)
    meta, tensors = store.load(folder, side, pfp, cfp)
    return PairArtifacts(meta, tensors, side)


def _context(model: EngineModel, artifacts) -> CodecContext:
    """A codec context over the engine's model stand-in: it has what the methods the connector runs
    (``transfers.SUPPORTED``, checked before any is made) read of a model, and no weights."""
    return CodecContext(cast(ModelAdapter, model), artifacts)


class SCDConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = self._kv_transfer_config
        self.producer = tc.kv_role == "kv_producer"
        if tc.kv_role not in ("kv_producer", "kv_consumer"):
            raise ValueError(f"SCDConnector runs as kv_producer or kv_consumer; got kv_role={tc.kv_role!r}")
        self.cfg = parse_extra(tc.kv_role, tc.kv_connector_extra_config)  # every key checked, for both roles
        self.block_size = vllm_config.cache_config.block_size
        self.stats: dict[str, int] = {}
        self._stats_lock = threading.Lock()
        self._stats_file = self.cfg.stats_file
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker(vllm_config)

    # ------------------------------------------------------------------ counters
    def _count(self, **kw: int) -> None:
        with self._stats_lock:
            for k, v in kw.items():
                self.stats[k] = self.stats.get(k, 0) + v
            if self._stats_file:
                path = f"{self._stats_file}.{'scheduler' if self.role == KVConnectorRole.SCHEDULER else 'worker'}"
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".stats.")
                with os.fdopen(fd, "w") as f:
                    json.dump(self.stats, f)
                os.replace(tmp, path)

    # ------------------------------------------------------------------ scheduler side
    def _init_scheduler(self) -> None:
        self._matched: dict[str, tuple[str, int]] = {}  # req_id -> (key, transferred positions)
        self._pending_loads: dict[str, LoadSpec] = {}
        self._requested: dict[str, tuple[str, dict[str, str], str]] = {}  # req_id -> (method, params, consumer)
        self._lookup = None
        if not self.producer:
            assert isinstance(self.cfg, ConsumerExtra)
            self._lookup = pbg.KVReceiverStub(grpc.insecure_channel(self.cfg.listen))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.producer:  # the producer computes every token; note a request's own method, if any
            p = request.kv_transfer_params or {}
            if "scd_method" in p or "scd_consumer" in p:
                params = {k: str(v) for k, v in dict(p.get("scd_method_params") or {}).items()}
                self._requested[request.request_id] = (str(p.get("scd_method", "")), params,
                                                       str(p.get("scd_consumer", "")))
            return 0, False
        ids = list(request.prompt_token_ids or [])
        top = (len(ids) - 1) // self.block_size * self.block_size  # full blocks, the last token left to compute
        if request.request_id in self._matched:
            _, n = self._matched[request.request_id]
            return max(0, n - num_computed_tokens), False
        if top <= num_computed_tokens:
            return 0, False
        cands = {prompt_key(ids[:n]): n for n in range(top, num_computed_tokens, -self.block_size)}
        assert self._lookup is not None  # a consumer's scheduler side
        try:
            reply = self._lookup.Lookup(pb.LookupRequest(keys=list(cands)[:64]), timeout=5)
        except grpc.RpcError as e:
            log.warning("SCD connector: the receiver did not answer a lookup (%s); computing the prompt", e.code())
            self._count(lookup_errors=1)
            return 0, False
        usable = [e for e in reply.entries if e.state in ("ready", "receiving") and e.n_tokens == cands[e.key]]
        failed = [e for e in reply.entries if e.state == "failed"]
        if failed and not usable:
            log.warning("SCD connector: the transfer of this prompt failed (%s); computing it", failed[0].error)
            self._count(transfers_refused=1)
        if not usable:
            self._count(lookups_missed=1)
            return 0, False
        best = max(usable, key=lambda e: e.n_tokens)
        self._matched[request.request_id] = (best.key, best.n_tokens)
        self._count(lookups_hit=1)
        return best.n_tokens - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens <= 0 or request.request_id not in self._matched:
            return
        key, n = self._matched[request.request_id]
        self._pending_loads[request.request_id] = LoadSpec(request.request_id, key, n - num_external_tokens, n, [])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = SCDMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = list(new.block_ids[0])
            if new.req_id in self._pending_loads:
                spec = self._pending_loads.pop(new.req_id)
                spec.block_ids = block_ids
                meta.loads.append(spec)
            elif self.producer:
                ids = list(new.prompt_token_ids or [])
                n = (len(ids) - 1) // self.block_size * self.block_size
                if n == 0:
                    continue
                if scheduler_output.num_scheduled_tokens.get(new.req_id, 0) < len(ids):
                    log.warning("SCD connector: prompt %s is prefilled in chunks; not transferred (raise "
                                "max_num_batched_tokens above the prompt length)", new.req_id)
                    self._count(chunked_not_sent=1)
                    continue
                method, params, dest = self._requested.pop(new.req_id, ("", {}, ""))
                meta.saves.append(SaveSpec(new.req_id, prompt_key(ids[:n]), ids[: n + 1], block_ids, method, params,
                                           dest))
        self._pending_loads.clear()  # a load not scheduled now (preempted) is recomputed
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._matched.pop(request.request_id, None)
        self._pending_loads.pop(request.request_id, None)
        self._requested.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side
    def _init_worker(self, vllm_config) -> None:
        from shared.model.loading import folder_fingerprint

        mc = vllm_config.model_config
        self.model = EngineModel(mc.hf_config, "cpu", mc.dtype)
        self.fingerprint = folder_fingerprint(mc.model)
        self.timeout_s = self.cfg.timeout_s
        self._kv: dict[str, torch.Tensor] = {}
        self._isa: str | None = None
        self._checked = False
        self._failed_blocks: set[int] = set()
        self._loads: list[tuple[LoadSpec, Any, torch.Tensor]] = []
        self._out: dict[str, tuple[SaveSpec, Outgoing, torch.Tensor]] = {}
        if isinstance(self.cfg, ProducerExtra):
            art = _artifacts(self.cfg.artifacts, "producer", None, self.fingerprint)
            self.ctx = _context(self.model, art)
            self._methods: dict[tuple, Any] = {}
            self.default = self.cfg.default()
            self._method(*self.default)  # fail fast on the engine's own settings
            self._consumers = dict(self.cfg.consumers)
            self._default_consumer = self.cfg.consumer
            self._channels: dict[str, grpc.Channel] = {}
            self._doctor = AddressDoctor()
        else:
            c = self.cfg
            producer_fp = c.producer_fingerprint
            art = _artifacts(c.artifacts, "consumer", producer_fp, self.fingerprint)
            if art is not None and not producer_fp:
                producer_fp = art.meta.producer_fingerprint
            self.ctx = _context(self.model, art)
            self.receiver = Receiver(self.model, self.ctx, c.methods, producer_fp, max_bytes=c.max_held_bytes,
                                     ttl_s=c.ttl_s, frame_timeout_s=c.frame_timeout_s)
            self._server, port = serve_receiver(self.receiver, c.listen)
            log.info("SCD connector: receiver listening on port %d (methods %s)", port, list(c.methods))

    def _method(self, kind: str, params: dict[str, str]):
        """The registered method ``kind`` with ``params``, made once (``SCDError`` when it cannot run here)."""
        kind, params = resolve_variant(kind, params)  # a request's scd_method may carry settings (raw:dtype=float32)
        key = (kind, tuple(sorted(params.items())))
        if key not in self._methods:
            check_method(kind)
            self._methods[key] = make_method(kind, self.ctx, params)
        return self._methods[key]

    def _stub(self, name: str) -> pbg.KVReceiverStub:
        """The receiver a request goes to: ``consumers[name]`` (names only, so a request cannot point the
        producer at an arbitrary address), or the engine's ``consumer`` when it names none."""
        if name and name not in self._consumers:
            raise UnknownMethod(f"unknown consumer {name!r} in kv_transfer_params scd_consumer; this producer "
                                f"engine knows {sorted(self._consumers)}")
        address = self._address(name)
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(address)
        return pbg.KVReceiverStub(self._channels[address])

    def _address(self, name: str) -> str:
        return self._consumers.get(name, self._default_consumer) if name else self._default_consumer

    def _layer(self, name: str) -> int:
        m = LAYER_RE.search(name)
        if m is None:
            raise ValueError(f"cannot tell the layer index of attention layer {name!r}")
        return int(m.group(1))

    def _cache_isa(self, kv: torch.Tensor) -> str:
        if self._isa is None:
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            d = kv.shape[-1] // 2
            self._isa = _get_attn_isa(kv.dtype, self.block_size, d)
        if not self._checked:
            paged.check_layout(kv, self._isa)
            self._checked = True
        return self._isa

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv = dict(kv_caches)
        if self._kv:
            self._cache_isa(next(iter(self._kv.values())))

    def _kv_of(self, name: str, forward_context=None) -> torch.Tensor:
        if name in self._kv:
            return self._kv[name]
        from vllm.forward_context import get_forward_context

        kv = (forward_context or get_forward_context()).no_compile_layers[name].kv_cache
        kv = kv[0] if isinstance(kv, (list, tuple)) else kv
        self._kv[name] = kv
        return kv

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, SCDMetadata)
        self._loads = []
        for spec in meta.loads:
            t = self.receiver.claim(spec.key)
            if t is None:
                self._fail(spec, "the transfer is no longer held (expired or superseded)")
                continue
            self._loads.append((spec, t, _slots(spec.block_ids, spec.first, spec.n_tokens, self.block_size)))
            self._count(loads_started=1)

    def _fail(self, spec: LoadSpec, why: str) -> None:
        log.warning("SCD connector: load of %s failed (%s); its blocks are reported for recompute", spec.req_id, why)
        first_block, last_block = spec.first // self.block_size, (spec.n_tokens - 1) // self.block_size
        self._failed_blocks.update(spec.block_ids[first_block:last_block + 1])
        self.receiver.release(spec.key)
        self._count(loads_failed=1)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.producer or not self._loads:
            return
        i = self._layer(layer_name)
        kv = self._kv_of(layer_name)
        isa = self._cache_isa(kv)
        keep = []
        for spec, t, slots in self._loads:
            try:
                k, v = t.layer(i, self.timeout_s)
            except TransferFailed as e:
                self._fail(spec, str(e))
                continue
            paged.write(kv, k[spec.first:spec.n_tokens], v[spec.first:spec.n_tokens], slots, isa)
            self._count(layers_loaded=1)
            if i == self.model.n_layers - 1:
                self.receiver.done(spec.key)
                self._count(loads_done=1, tokens_loaded=spec.n_tokens - spec.first)
            else:
                keep.append((spec, t, slots))
        self._loads = keep

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        if not self.producer:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, SCDMetadata)
        if not meta.saves:
            return
        i = self._layer(layer_name)
        self._cache_isa(kv_layer)
        for spec in meta.saves:
            n = len(spec.token_ids) - 1
            if i == 0:
                try:
                    method = self._method(*((spec.method, spec.params) if spec.method else self.default))
                    stub = self._stub(spec.consumer)
                except SCDError as e:
                    log.warning("SCD connector: request %s not transferred: %s", spec.req_id, e)
                    self._count(method_refused=1)
                    continue
                header = make_header(method, self.fingerprint, spec.key, spec.token_ids, self.model.n_layers,
                                     self.timeout_s)
                self._out[spec.req_id] = (spec, Outgoing(stub, method, header, self.timeout_s),
                                          _slots(spec.block_ids, 0, n, self.block_size))
            if spec.req_id not in self._out:
                continue
            _, out, slots = self._out[spec.req_id]
            k, v = paged.read(kv_layer, slots)  # [T, H, D], keys rotated
            k = self.model.remove_rope(k.transpose(0, 1).unsqueeze(0).float())
            out.add_layer(i, k, v.transpose(0, 1).unsqueeze(0).float())

    def wait_for_save(self) -> None:
        if not self.producer:
            return
        for spec, out, _ in self._out.values():
            t = time.perf_counter()
            try:
                reply = out.close(self.timeout_s)
                self._count(sent=1, layers_sent=reply.layers, wire_bytes=reply.wire_bytes,
                            tokens_sent=len(spec.token_ids) - 1)
                log.info("SCD connector: %s sent %d layers, %d bytes (%.0f ms after the forward)", spec.req_id,
                         reply.layers, reply.wire_bytes, 1e3 * (time.perf_counter() - t))
            except grpc.RpcError as e:
                out.abort()
                self._count(send_failed=1)
                log.warning("SCD connector: the consumer refused %s: %s", spec.req_id,
                            self._doctor.explain(self._address(spec.consumer), e))
        self._out = {}

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def shutdown(self) -> None:
        if getattr(self, "_server", None) is not None:
            self._server.stop(1)
        for ch in getattr(self, "_channels", {}).values():
            ch.close()
