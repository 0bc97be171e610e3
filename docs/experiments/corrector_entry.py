# Research script (issue 16, 'a lighter corrector'), kept so that docs/scd-speed.md's numbers can be rerun:
#   .venv/bin/python docs/experiments/corrector_entry.py WIDTH LAYERS STEPS N_TRAIN   (e.g. 256 2 1500 128)
# Not part of the package and not imported by it; excluded from lint.
"""Exploratory probe (issue 16, 'a lighter corrector'): can a small learned cross-token module stand
in for the consumer's 10-layer PATCH block? Trains on calibration prompts, scores on validation with
the served SCD for everything outside the block."""
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from shared.codecs import CodecContext
from shared.codecs.quant import dequantize_rows, quantize_rows
from shared.codecs.scd import SCDSession
from shared.model.hf_adapter import to_rows
from tools.calibration import selection as sel
from tools.calibration.scoring import Scorer
from tools.cli.common import calibration_prompts, pair_models, validation_items

torch.manual_seed(0)
torch.set_num_threads(2)
A, B = 14, 24  # block 14-23, exit layer 24: targets are layers A..B inclusive
LAYERS = list(range(A, B + 1))
W = int(sys.argv[1]) if len(sys.argv) > 1 else 256
NL = int(sys.argv[2]) if len(sys.argv) > 2 else 2
STEPS = int(sys.argv[3]) if len(sys.argv) > 3 else 600
N_TRAIN = int(sys.argv[4]) if len(sys.argv) > 4 else 48

pm = pair_models("strong")
P, C = pm.producer, pm.consumer
cal = calibration_prompts(pm, None)[:N_TRAIN]


def wire(x):  # what the consumer gets: int8 per token
    q, s = quantize_rows(x.float(), 8)
    return dequantize_rows(q, s)


t0 = time.time()
data = []
for ids in cal:
    ids = ids[:1024][:-1]
    sp = P.prefill(ids, residual_layers=[A])
    sc = C.prefill(ids)
    r = wire(sp.residual[A][0])
    kv = torch.stack([torch.cat([to_rows(sc.keys[l]), to_rows(sc.values[l])], 1) for l in LAYERS])  # [L, T, 384]
    data.append((r.half(), kv.half()))
print(f"traces {len(data)} prompts {sum(d[0].shape[0] for d in data)} tokens {time.time() - t0:.0f}s", flush=True)
scale = torch.stack([d[1].float().pow(2).mean(1) for d in data]).mean(0).sqrt()  # [L, 384] per-dim rms


class Rope(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, x):  # [H, T, D]
        t = torch.arange(x.shape[1], dtype=torch.float32)
        f = torch.outer(t, self.inv)
        cos, sin = torch.cat([f, f], -1).cos(), torch.cat([f, f], -1).sin()
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat([-x2, x1], -1) * sin


class Block(nn.Module):
    def __init__(self, w, heads):
        super().__init__()
        self.h, self.d = heads, w // heads
        self.n1, self.n2 = nn.RMSNorm(w), nn.RMSNorm(w)
        self.qkv, self.o = nn.Linear(w, 3 * w, bias=False), nn.Linear(w, w, bias=False)
        self.up, self.down = nn.Linear(w, 4 * w, bias=False), nn.Linear(2 * w, w, bias=False)
        self.rope = Rope(self.d)

    def forward(self, x):  # [T, w]
        T = x.shape[0]
        q, k, v = self.qkv(self.n1(x)).view(T, 3, self.h, self.d).permute(1, 2, 0, 3)
        q, k = self.rope(q), self.rope(k)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(T, -1)
        x = x + self.o(a)
        g, u = self.up(self.n2(x)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


class Corrector(nn.Module):
    def __init__(self, d, w, n):
        super().__init__()
        self.inp = nn.Linear(d, w)
        self.blocks = nn.ModuleList(Block(w, max(1, w // 64)) for _ in range(n))
        self.nout = nn.RMSNorm(w)
        self.out = nn.Linear(w, len(LAYERS) * d)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, r):  # [T, d] -> residual per target layer [L, T, d]
        x = self.inp(r)
        for b in self.blocks:
            x = b(x)
        T, d = r.shape
        return r.unsqueeze(0) + self.out(self.nout(x)).view(T, len(LAYERS), d).transpose(0, 1)


# the consumer's own norm + k/v projections of each target layer, frozen, differentiable
proj = []
for l in LAYERS:
    lay = C.layers[l]
    proj.append((lay.input_layernorm, lay.self_attn.k_proj, lay.self_attn.v_proj))
for mods in proj:
    for m in mods:
        for p in m.parameters():
            p.requires_grad_(False)


def kv_of(res):  # [L, T, d] -> [L, T, 384]
    out = []
    for j, (n, kp, vp) in enumerate(proj):
        h = n(res[j])
        out.append(torch.cat([kp(h), vp(h)], -1))
    return torch.stack(out)


net = Corrector(P.hidden_size, W, NL)
n_par = sum(p.numel() for p in net.parameters())
opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / STEPS)))
t0 = time.time()
with torch.no_grad():
    base = sum(((kv_of(r.float().unsqueeze(0).expand(len(LAYERS), -1, -1)) - kv.float()) / scale.unsqueeze(1)).pow(2).mean()
               for r, kv in data[:8]) / 8
print(f"params {n_par / 1e6:.2f}M; entry-projection loss {float(base):.4f}", flush=True)
for step in range(STEPS):
    r, kv = data[step % len(data)]
    pred = kv_of(net(r.float()))
    loss = ((pred - kv.float()) / scale.unsqueeze(1)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    if step % 50 == 0 or step == STEPS - 1:
        print(f"step {step} loss {float(loss):.4f} {time.time() - t0:.0f}s", flush=True)
net.eval()

# ---- validation: served scd, with the block's layers (and exit) from the corrector
val = [(it.prompt_ids, it.prefix_len) for it in validation_items(pm, None, 24)]
kinds = [it.kind for it in validation_items(pm, None, 24)]
vps = sel.prepare_val(P, C, val, n_new=16, stop_ids=pm.fmt.stop_ids)
scorer = Scorer(P, C, vps, kinds)
from shared.artifacts import store  # noqa: E402
from shared.codecs.scd import PairArtifacts  # noqa: E402

folder = pm.store(None) / "strong"
meta, pt = store.load(folder, "producer")
_, ct = store.load(folder, "consumer")
pctx, cctx = CodecContext(P, PairArtifacts(meta, pt, "producer")), CodecContext(C, PairArtifacts(meta, ct, "consumer"))
enc, dec = scorer.pair("scd", None, pctx, cctx)
kl_scd = scorer.kl(enc, dec)
print("served scd", kl_scd, scorer.last_by_kind, flush=True)
orig = SCDSession.run_block
tm = []


def run_block(self, h, block):
    t = time.perf_counter()
    with torch.no_grad():
        kv = kv_of(net(h.float()))
    tm.append((time.perf_counter() - t, h.shape[0]))
    s = self.job.start
    m = self.model
    for j, l in enumerate(LAYERS):
        k = kv[j, :, : m.kv_dim].view(-1, m.n_kv_heads, m.head_dim).transpose(0, 1).unsqueeze(0)
        v = kv[j, :, m.kv_dim:].view(-1, m.n_kv_heads, m.head_dim).transpose(0, 1).unsqueeze(0)
        self._block_kv[l] = (k[:, :, s:].contiguous(), v[:, :, s:].contiguous())
    return self._block_kv.pop(A)


SCDSession.run_block = run_block
enc, dec = scorer.pair("scd", None, pctx, cctx)
kl_c = scorer.kl(enc, dec)
byk = dict(scorer.last_by_kind)
SCDSession.run_block = orig
kl_raw = scorer.kl(*scorer.pair("raw"))
t = time.perf_counter()
for vp in vps[:4]:
    C.prefill(vp.ids[:-1])
pf = (time.perf_counter() - t) / sum(len(vp.ids) - 1 for vp in vps[:4])
cm = sum(a for a, _ in tm) / sum(n for _, n in tm)
print(f"RESULT W={W} NL={NL} steps={STEPS} ntrain={N_TRAIN} params={n_par / 1e6:.2f}M "
      f"corrector KL {kl_c:.4f} {byk} | served scd {kl_scd:.4f} | raw {kl_raw:.4f} | "
      f"corrector ms/tok {cm * 1e3:.4f} vs prefill ms/tok {pf * 1e3:.4f} ratio {cm / pf:.3f}", flush=True)
