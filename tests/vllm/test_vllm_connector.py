"""SCD inside vLLM (``make test-vllm``, in ``.venv-vllm``): a producer vLLM engine on the SmolLM2 base
and a consumer vLLM engine on the ``strong`` fine-tune, each with ``SCDConnector``, the prompt's cache
moved by the connector over the project's wire protocol; compared with the project's own services
and ``scd eval`` on the same prompt (``reference.py``, run in the project's environment)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
ROOT = Path(__file__).resolve().parents[2]
PROJECT_PY = Path(os.environ.get("SCD_PROJECT_PYTHON", ROOT / ".venv" / "bin" / "python"))
N_PROMPT, NEW = 257, 16  # 256 positions = two full 128-token blocks transferred; the last token computed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    from tools import data

    ids = next(it.prompt_ids for it in data.load("qa", "test", 8) if len(it.prompt_ids) > N_PROMPT)
    return ids[:N_PROMPT]


@pytest.fixture(scope="module")
def reference(prompt, tmp_path_factory) -> dict:
    d = tmp_path_factory.mktemp("ref")
    (d / "in.json").write_text(json.dumps({"ids": prompt, "new_tokens": NEW, "methods": ["raw", "scd-reuse"]}))
    r = subprocess.run([str(PROJECT_PY), str(ROOT / "tests" / "vllm" / "reference.py"), str(d / "in.json"),
                        str(d / "out.json")], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads((d / "out.json").read_text())


@pytest.fixture(scope="module")
def engines(tmp_path_factory, reference):  # the reference first: its models and vLLM's do not share memory
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from tools.assets.models import consumer_dir, producer_dir
    from tools.assets.registry import default_store

    d = tmp_path_factory.mktemp("stats")
    port = free_port()
    artifacts = str(default_store(builtin=True) / "strong")

    def engine(model, role, extra):
        return LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=2048, seed=0, max_logprobs=-1,
                   enable_prefix_caching=False,  # every load below is the connector's, never a local cache hit
                   kv_transfer_config=KVTransferConfig(
                       kv_connector="SCDConnector", kv_role=role, kv_load_failure_policy="recompute",
                       kv_connector_module_path="integrations.vllm_connector.connector",
                       kv_connector_extra_config={**extra, "artifacts": artifacts}))

    cons = engine(consumer_dir("strong"), "kv_consumer", {"listen": f"127.0.0.1:{port}", "stats_file": str(d / "c")})
    prod = engine(producer_dir(), "kv_producer", {"consumer": f"127.0.0.1:{port}", "stats_file": str(d / "p")})
    yield {"consumer": cons, "producer": prod, "port": port, "stats": d}
    for e in (prod, cons):  # the engine processes go now, not when the interpreter exits
        e.llm_engine.engine_core.shutdown()


def stats(engines, side: str, role: str) -> dict:
    f = engines["stats"] / f"{side}.{role}"
    return json.loads(f.read_text()) if f.exists() else {}


def produce(engines, ids, **transfer_params) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": transfer_params} if transfer_params else None
    engines["producer"].generate([TokensPrompt(prompt_token_ids=ids)],
                                 SamplingParams(max_tokens=1, temperature=0, extra_args=extra), use_tqdm=False)


def consume(engines, ids, max_tokens=NEW, logprobs=None):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    (out,) = engines["consumer"].generate([TokensPrompt(prompt_token_ids=ids)],
                                          SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=logprobs),
                                          use_tqdm=False)
    return out


@pytest.fixture(scope="module")
def native(engines, prompt):
    """The consumer engine's own answer (nothing transferred yet: the lookup misses)."""
    out = consume(engines, prompt)
    assert out.num_cached_tokens == 0
    return list(out.outputs[0].token_ids)


def test_raw_through_the_connector_equals_the_projects_services(engines, prompt, reference, native):
    before = stats(engines, "c", "worker")
    produce(engines, prompt)
    sent = stats(engines, "p", "worker")
    assert sent["layers_sent"] == 30 and sent["tokens_sent"] == N_PROMPT - 1
    out = consume(engines, prompt)
    got = list(out.outputs[0].token_ids)
    assert reference["services_method"] == "raw"
    assert got == reference["services_raw"], f"connector {got} vs services {reference['services_raw']}"
    after = stats(engines, "c", "worker")
    # every layer loaded, all 256 transferred positions, and vLLM counts them as computed elsewhere
    assert after["layers_loaded"] - before.get("layers_loaded", 0) == 30
    assert after["tokens_loaded"] - before.get("tokens_loaded", 0) == N_PROMPT - 1
    assert out.num_cached_tokens == N_PROMPT - 1


def test_scd_reuse_teacher_forced_kl_matches_scd_eval(engines, prompt, reference):
    """The Oracle's continuation teacher-forced through the consumer engine after an scd-reuse transfer:
    KL(Oracle || connector) per token, the Oracle's log-probabilities from the project's harness."""
    import torch

    target = reference["target"]
    produce(engines, prompt, scd_method="scd-reuse")
    oracle = torch.load(reference["oracle_logprobs"])  # [len(target), vocab]
    kls = []
    for j in range(len(target)):
        # the Oracle's tokens fed one request at a time (vLLM gives no prompt log-probs for positions a
        # connector loaded): each reuses the held transfer and computes the rest of its prompt itself
        out = consume(engines, prompt + target[:j], max_tokens=1, logprobs=-1)
        assert out.num_cached_tokens == N_PROMPT - 1
        lp = out.outputs[0].logprobs[0]  # the engine's log-probs over the whole vocabulary, predicting target[j]
        m = torch.full((oracle.shape[1],), float("-inf"))
        m[list(lp)] = torch.tensor([x.logprob for x in lp.values()])
        assert len(lp) == oracle.shape[1]
        kls.append(float((oracle[j].exp() * (oracle[j] - m)).sum()))
    kl = sum(kls) / len(kls)
    want = reference["kl"]["scd-reuse"]
    print(f"\nscd-reuse teacher-forced KL over {len(target)} tokens: connector {kl:.4f}, scd eval {want:.4f}")
    assert abs(kl - want) <= 0.1 * want, f"connector scd-reuse KL {kl:.4f}; scd eval on this prompt {want:.4f}"


def test_a_corrupted_code_byte_is_recomputed_never_served(engines, prompt, native):
    """A producer whose frames carry one flipped byte: the receiver refuses the stream (DATA_LOSS), the
    scheduler finds no usable transfer and the consumer computes the prompt itself."""
    import grpc

    from integrations.vllm_connector.engine_model import EngineModel
    from integrations.vllm_connector.transfers import LayerState, make_header, prompt_key
    from shared.codecs import CodecContext, make_method
    from shared.model.hf_adapter import ModelAdapter
    from shared.model.loading import folder_fingerprint, load_model
    from shared.rpc import scd_pb2_grpc as pbg
    from shared.rpc.wire import StreamTotals, header_frame, layer_frames
    from tools.assets.models import producer_dir

    base = ModelAdapter(load_model(producer_dir()))
    em = EngineModel(base.config)
    method = make_method("raw", CodecContext(em))
    state = base.prefill(prompt[:-1])
    refused = stats(engines, "c", "scheduler").get("transfers_refused", 0)
    totals = StreamTotals()
    header = make_header(method, folder_fingerprint(producer_dir()), prompt_key(prompt[:-1]), prompt, em.n_layers, 60)
    frames = [totals.add(header_frame(header))]
    for layer in range(em.n_layers):
        st = LayerState(prompt[:-1])
        st.keys[layer], st.values[layer] = state.keys[layer], state.values[layer]
        for f in layer_frames(layer, method.encode_layer(st, layer, 0)):
            if layer == 7 and f.chunk.last:  # one byte of layer 7's code flipped after its checksum was taken
                data = bytearray(f.chunk.data)
                data[len(data) // 3] ^= 0x10
                f.chunk.data = bytes(data)
            frames.append(totals.add(f))
    frames.append(totals.trailer())
    with grpc.insecure_channel(f"127.0.0.1:{engines['port']}") as ch, pytest.raises(grpc.RpcError) as e:
        pbg.KVReceiverStub(ch).Push(iter(frames), timeout=60)
    assert e.value.code() == grpc.StatusCode.DATA_LOSS and "crc32c" in e.value.details()
    res = consume(engines, prompt)
    assert res.num_cached_tokens == 0  # nothing was loaded
    assert list(res.outputs[0].token_ids) == native  # the consumer's own answer, not the corrupted cache's
    assert stats(engines, "c", "scheduler")["transfers_refused"] == refused + 1


def test_scd_is_refused_in_the_connector_and_the_prompt_computed(engines, prompt):
    from tools import data

    other = next(it.prompt_ids[:N_PROMPT] for it in data.load("qa", "test", 8)
                 if len(it.prompt_ids) > N_PROMPT and it.prompt_ids[:N_PROMPT] != prompt)
    own = consume(engines, other)
    assert own.num_cached_tokens == 0
    refused = stats(engines, "p", "worker").get("method_refused", 0)
    produce(engines, other, scd_method="scd")  # needs the consumer's layers: the producer sends nothing
    produce(engines, other, scd_consumer="elsewhere")  # only consumers named in its settings are reachable
    assert stats(engines, "p", "worker")["method_refused"] == refused + 2
    res = consume(engines, other)
    assert res.num_cached_tokens == 0 and list(res.outputs[0].token_ids) == list(own.outputs[0].token_ids)


def test_a_request_method_with_settings_is_taken_as_the_cli_writes_it(engines, prompt):
    """``kv_transfer_params: {"scd_method": "raw:dtype=float32"}`` was refused as an unknown method."""
    from tools import data

    others = [it.prompt_ids[:N_PROMPT] for it in data.load("qa", "test", 16)
              if len(it.prompt_ids) > N_PROMPT and it.prompt_ids[:N_PROMPT] != prompt][-3:]
    before = stats(engines, "p", "worker")
    produce(engines, others[0])  # the engine's default: raw, float16 on the wire
    mid = stats(engines, "p", "worker")
    produce(engines, others[1], scd_method="raw:dtype=float32")
    after = stats(engines, "p", "worker")
    fp16, fp32 = mid["wire_bytes"] - before.get("wire_bytes", 0), after["wire_bytes"] - mid["wire_bytes"]
    assert after["sent"] == mid["sent"] + 1 and fp32 > 1.8 * fp16, (fp16, fp32)
    produce(engines, others[2], scd_method="raw:dtype=float32", scd_method_params={"dtype": "float16"})
    assert stats(engines, "p", "worker")["method_refused"] == after.get("method_refused", 0) + 1  # set twice
