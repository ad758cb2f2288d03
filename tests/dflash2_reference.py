"""A PyTorch reference of DFlash2 drafters (vLLM's `qwen3_dflash2.py` semantics) for parity tests.

- `write_dflash2_drafter`: a random (or identity) DFlash2 drafter for an HF target, as
  config.json + model.safetensors (float32, no `model.` prefix).
- `DFlash2Reference`: the target (transformers) plus the drafter (plain torch), with the drafter
  forward, the candidate selector (top-k candidates, edge scores, the walk), and greedy
  speculative decoding.

Run `python tests/dflash2_reference.py` for the smoke check (losslessness, how often the selector
walk differs from the plain argmax, and the identity drafter against greedy_cases.json).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

REF = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reference", "tiny-qwen3-dflash")


def write_dflash2_drafter(target_dir, out_dir, *, block_size=8, layers=2, taps=(1, 3), conv_kernel_size=2,
                          conv_group_size=16, selector_rank=8, selector_top_k=4, output_multiplier=1.0,
                          final_logit_softcapping=None, input_embedding_scale=1.0, intermediate_size=96, seed=0,
                          identity=False, base_dir=None):
    """Write a DFlash2 drafter for the HF target in `target_dir` to `out_dir`; returns its config dict.

    Random weights are large enough that every part matters. identity=True: the convs are the
    identity (tap 0 = 1, no kernel projection) and the codebooks are zero, so the selector walk is
    the argmax and the drafter is a plain DFlash drafter. base_dir: a plain DFlash drafter whose
    tensors and shape/config fields (layers, block size, taps, mask, intermediate size) are kept.
    """
    with open(os.path.join(target_dir, "config.json")) as f:
        t = json.load(f)
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, s=1.0: s * torch.randn(*shape, generator=g)
    H, hd, V = t["hidden_size"], t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"], t["vocab_size"]
    nh, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    if base_dir is not None:
        with open(os.path.join(base_dir, "config.json")) as f:
            cfg = json.load(f)
        w = dict(load_file(os.path.join(base_dir, "model.safetensors")))
        layers, block_size = cfg["num_hidden_layers"], cfg["block_size"]
    else:
        cfg = {"hidden_act": "silu", "num_hidden_layers": layers, "intermediate_size": intermediate_size,
               "block_size": block_size, "dflash_config": {"mask_token_id": V - 1, "target_layer_ids": list(taps)}}
        I, norm = intermediate_size, lambda n: 1 + rnd(n, s=0.1)
        w = {"fc.weight": rnd(H, len(taps) * H, s=0.05), "hidden_norm.weight": norm(H), "norm.weight": norm(H)}
        for i in range(layers):
            p = f"layers.{i}."
            w |= {p + "self_attn.q_proj.weight": rnd(nh * hd, H, s=0.05), p + "self_attn.k_proj.weight": rnd(nkv * hd, H, s=0.05),
                  p + "self_attn.v_proj.weight": rnd(nkv * hd, H, s=0.05), p + "self_attn.o_proj.weight": rnd(H, nh * hd, s=0.05),
                  p + "self_attn.q_norm.weight": norm(hd), p + "self_attn.k_norm.weight": norm(hd),
                  p + "input_layernorm.weight": norm(H), p + "post_attention_layernorm.weight": norm(H),
                  p + "mlp.gate_proj.weight": rnd(I, H, s=0.05), p + "mlp.up_proj.weight": rnd(I, H, s=0.05),
                  p + "mlp.down_proj.weight": rnd(H, I, s=0.05)}
    K, gs, R = conv_kernel_size, conv_group_size, selector_rank
    assert H % gs == 0, "conv_group_size must divide hidden_size"
    G = H // gs
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, K, H)
            base[:, 0, :] = 1.0
            proj = torch.zeros(2 * K * G, H)
            if not identity:
                base, proj = base + rnd(2, K, H, s=0.3), rnd(2 * K * G, H, s=0.05)
            w[f"layers.{i}.{conv}.base_kernel"], w[f"layers.{i}.{conv}.kernel_projection.weight"] = base, proj
    w["candidate_selector.hidden_projection.weight"] = rnd(R, H, s=0.2)
    for book in ("predecessor_codebook", "successor_codebook"):
        w[f"candidate_selector.{book}"] = torch.zeros(V, R) if identity else rnd(V, R, s=0.25)
    dflash = {**cfg.get("dflash_config", {}), "conv_kernel_size": K, "conv_group_size": gs, "selector_rank": R,
              "selector_top_k": selector_top_k, "output_multiplier": output_multiplier,
              "final_logit_softcapping": final_logit_softcapping, "input_embedding_scale": input_embedding_scale}
    cfg = {**cfg, "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
           "hidden_size": H, "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd,
           "rms_norm_eps": t["rms_norm_eps"], "rope_theta": t.get("rope_theta", 10000.0), "rope_scaling": None,
           "max_position_embeddings": t["max_position_embeddings"], "vocab_size": V, "attention_bias": False,
           "tie_word_embeddings": False, "num_target_layers": t["num_hidden_layers"],
           "layer_types": ["full_attention"] * layers, "sliding_window": None, "use_sliding_window": False,
           "dtype": "float32", "dflash_config": dflash}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file({k: v.float().contiguous() for k, v in w.items()}, os.path.join(out_dir, "model.safetensors"))
    return cfg


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):
    """HF Qwen3 RoPE (rotate_half) of x [T, heads, hd] at positions pos [T]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd)
    ang = torch.cat([pos.float()[:, None] * inv[None]] * 2, -1)[:, None, :]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
    return x * ang.cos() + torch.cat([-x2, x1], -1) * ang.sin()


class DFlash2Reference:
    """Target (transformers, float32) + DFlash2 drafter (its safetensors, read directly)."""

    def __init__(self, target_dir, drafter_dir):
        from transformers import AutoModelForCausalLM
        torch.set_grad_enabled(False)
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        with open(os.path.join(drafter_dir, "config.json")) as f:
            self.cfg = c = json.load(f)
        d = c["dflash_config"]
        self.w = load_file(os.path.join(drafter_dir, "model.safetensors"))
        self.B, self.mask, self.taps = c["block_size"], d["mask_token_id"], d["target_layer_ids"]
        self.K, self.gs, self.Kc = d["conv_kernel_size"], d["conv_group_size"], d["selector_top_k"]
        self.mult = d.get("output_multiplier", 1.0) or 1.0
        self.cap = d.get("final_logit_softcapping") or None
        self.emb_scale = d.get("input_embedding_scale", 1.0) or 1.0
        self.eps, self.theta = c["rms_norm_eps"], c["rope_theta"]
        self.nh, self.nkv, self.hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.head = self.target.get_output_embeddings().weight.float()

    # ---------------------------------------------------------------- target
    def _target(self, ids):
        return self.target(torch.as_tensor(ids)[None], output_hidden_states=True)

    def context_features(self, ids):
        """[T, n_taps*H]: HF hidden_states[l + 1] for l in target_layer_ids, concatenated in order."""
        hs = self._target(ids).hidden_states
        return torch.cat([hs[l + 1][0] for l in self.taps], -1).float()

    # ---------------------------------------------------------------- drafter
    def _conv(self, y, d, p, side):
        """vLLM's grouped dynamic conv: coeff[t,tap,c] = base[side,tap,c] + delta[t,side,tap,c//gs];
        out[t,c] = sum_{tap <= pos(t)} coeff[t,tap,c] * y[t-tap,c], pos(t) = t mod block_size."""
        T, H = y.shape
        delta = d.reshape(T, 2, self.K, H // self.gs)[:, side].repeat_interleave(self.gs, -1)
        coeff = self.w[p + "base_kernel"][side][None] + delta  # [T, K, H]
        pos = torch.arange(T) % self.B
        out = torch.zeros_like(y)
        for tap in range(self.K):
            shifted = torch.cat([y.new_zeros(tap, H), y[: T - tap]]) if tap else y
            out = out + (pos >= tap)[:, None] * coeff[:, tap] * shifted
        return out

    def _attn(self, h, ctx, bpos, cpos, p):
        """DFlash KV injection: block queries attend, unmasked, to [context keys ; block keys];
        context K/V = k_norm(k_proj(ctx)) rotated at 0..P-1 and v_proj(ctx)."""
        w, hd = self.w, self.hd
        lin = lambda x, n: x @ w[p + n + ".weight"].T
        q = _rope(_rms(lin(h, "q_proj").view(-1, self.nh, hd), w[p + "q_norm.weight"], self.eps), bpos, self.theta)
        kv_in, kv_pos = torch.cat([ctx, h]), torch.cat([cpos, bpos])
        k = _rope(_rms(lin(kv_in, "k_proj").view(-1, self.nkv, hd), w[p + "k_norm.weight"], self.eps), kv_pos, self.theta)
        v = lin(kv_in, "v_proj").view(-1, self.nkv, hd)
        rep = self.nh // self.nkv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        a = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd), -1)
        return lin(torch.einsum("hqk,khd->qhd", a, v).reshape(h.shape[0], -1), "o_proj")

    def drafter_hidden(self, block_ids, positions, features):
        """Drafter output after `norm`, [B, H], for block_ids [B] at positions [B] (P..P+B-1) with
        context features [P, n*H] (positions 0..P-1). Each layer follows qwen3_dflash2.py:
        conv0 -> attention -> conv1 around the attention, and the same around the MLP."""
        w, eps = self.w, self.eps
        x = self.target.get_input_embeddings()(torch.as_tensor(block_ids)).float() * self.emb_scale
        ctx = _rms(features.float() @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
        bpos, cpos = torch.as_tensor(positions), torch.arange(features.shape[0])
        for i in range(self.cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            h = _rms(x, w[p + "input_layernorm.weight"], eps)
            d = h @ w[p + "attention_conv.kernel_projection.weight"].T
            a = self._attn(self._conv(h, d, p + "attention_conv.", 0), ctx, bpos, cpos, p + "self_attn.")
            x = x + self._conv(a, d, p + "attention_conv.", 1)
            h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
            d = h @ w[p + "mlp_conv.kernel_projection.weight"].T
            h = self._conv(h, d, p + "mlp_conv.", 0)
            m = (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
            x = x + self._conv(m, d, p + "mlp_conv.", 1)
        return _rms(x, w["norm.weight"], eps)

    # ---------------------------------------------------------------- candidate selector
    def candidates(self, hidden):
        """hidden [B-1, H] (slots 1..B-1) -> C [B-1, Kc] (top-k of the target head's raw float32
        logits, descending) and U [B-1, Kc] = values * output_multiplier, then softcapped if set."""
        vals, C = torch.topk(hidden.float() @ self.head.T, self.Kc, dim=-1)
        U = vals * self.mult
        if self.cap:
            U = torch.tanh(U / self.cap) * self.cap
        return C, U

    def edge_scores(self, hidden, C, U, anchor):
        """S [B-1, Kc, Kc]: S[s,i,j] = U[s,j] + sum_r A[pred(s,i),r] w_s[r] Bk[C[s,j],r], w_s =
        hidden_projection(h_s); pred(1,i) = anchor, pred(s,i) = C[s-1,i] for s > 1."""
        A, Bk = self.w["candidate_selector.predecessor_codebook"], self.w["candidate_selector.successor_codebook"]
        ws = hidden.float() @ self.w["candidate_selector.hidden_projection.weight"].T  # [B-1, R]
        pred = torch.cat([torch.full((1, self.Kc), int(anchor)), C[:-1]])  # [B-1, Kc]
        return U[:, None, :] + torch.einsum("sir,sr,sjr->sij", A[pred], ws, Bk[C])

    def walk(self, S, C, temperature=0.0, generator=None):
        """The walk: prev = 0; row = S[s, prev]; idx = argmax(row) (lowest index on ties), or the
        Gumbel-max of row / T at T > 0; draft_s = C[s, idx]; prev = idx. -> (drafts, rows)."""
        prev, drafts, rows = 0, [], []
        for s in range(S.shape[0]):
            row = S[s, prev]
            if temperature > 0:
                u = torch.rand(row.shape, generator=generator).clamp_min(1e-20)
                idx = int(torch.argmax(row / temperature - torch.log(-torch.log(u))))
            else:
                idx = int(torch.argmax(row))  # torch.argmax returns the first maximum
            drafts.append(int(C[s, idx]))
            rows.append(row)
            prev = idx
        return torch.tensor(drafts), torch.stack(rows)

    @staticmethod
    def walk_rows(S, path):
        """The rows [B-1, Kc] a walk that chose candidate indices `path` [B-1] read."""
        prev = [0] + [int(i) for i in path[:-1]]
        return torch.stack([S[s, p] for s, p in enumerate(prev)])

    @staticmethod
    def proposal(rows, temperature):
        """The realised proposal q_s over the candidates: softmax(row / T), [B-1, Kc]."""
        return torch.softmax(rows / temperature, -1)

    def draft(self, seq):
        """Greedy drafts [B-1] after seq (its last token is the anchor), plus the plain argmax of U."""
        P = len(seq) - 1
        feats = self.context_features(seq[:-1]) if P else torch.zeros(0, len(self.taps) * self.head.shape[1])
        hidden = self.drafter_hidden([seq[-1]] + [self.mask] * (self.B - 1), torch.arange(P, P + self.B), feats)[1:]
        C, U = self.candidates(hidden)
        drafts, _ = self.walk(self.edge_scores(hidden, C, U, seq[-1]), C)
        return drafts, C[torch.arange(len(C)), U.argmax(-1)]

    # ---------------------------------------------------------------- decoding
    def plain_greedy(self, prompt_ids, max_new_tokens):
        """Target argmax decoding -> prompt + max_new_tokens tokens."""
        seq = list(prompt_ids)
        for _ in range(max_new_tokens):
            seq.append(int(self._target(seq).logits[0, -1].argmax()))
        return seq

    def generate(self, prompt_ids, max_new_tokens):
        """Greedy speculative decoding with the selector (the target rerun over the whole sequence
        each cycle). output_ids = prompt + max_new_tokens tokens; cycles run while the generated
        count (first token included) is <= max_new_tokens; acceptance length = a + 1."""
        seq = list(prompt_ids) + [int(self._target(list(prompt_ids)).logits[0, -1].argmax())]
        acc, per_cycle = [], []
        while len(seq) - len(prompt_ids) <= max_new_tokens:
            drafts, _ = self.draft(seq)
            verify = self._target(seq + drafts.tolist()).logits[0, len(seq) - 1:].argmax(-1)  # [B]
            a = 0
            while a < len(drafts) and int(drafts[a]) == int(verify[a]):
                a += 1
            seq += drafts[:a].tolist() + [int(verify[a])]
            acc.append(a + 1)
            per_cycle.append(drafts.tolist())
        return dict(output_ids=seq[: len(prompt_ids) + max_new_tokens], acceptance_lengths=acc,
                    drafts_per_cycle=per_cycle)


def _smoke():
    import tempfile
    import numpy as np
    target = os.path.join(REF, "target")
    with tempfile.TemporaryDirectory() as tmp:
        rand_dir, ident_dir = os.path.join(tmp, "rand"), os.path.join(tmp, "ident")
        write_dflash2_drafter(target, rand_dir)
        write_dflash2_drafter(target, ident_dir, identity=True, base_dir=os.path.join(REF, "drafter"))
        ref = DFlash2Reference(target, rand_dir)
        g = torch.Generator().manual_seed(1)
        differ = slots = 0
        for n in (5, 9, 15):
            prompt = torch.randint(0, ref.head.shape[0] - 1, (n,), generator=g).tolist()
            out = ref.generate(prompt, 24)
            assert out["output_ids"] == ref.plain_greedy(prompt, 24), "not lossless"
            print(f"random drafter, prompt len {n}: lossless, acceptance {out['acceptance_lengths']}")
            for k in range(len(out["output_ids"]) - n):  # walk vs argmax of U at each prefix
                walked, argmax_u = ref.draft(out["output_ids"][: n + 1 + k])
                differ += int((walked != argmax_u).sum())
                slots += len(walked)
        print(f"selector walk differs from argmax(U) on {differ}/{slots} slots ({differ / slots:.0%})")
        assert differ > 0

        ident = DFlash2Reference(target, ident_dir)
        e = np.load(os.path.join(REF, "expected.npz"))
        P = e["prompt"].shape[1]
        h = ident.drafter_hidden(e["block_ids"][0].tolist(), torch.arange(P, P + 8),
                                 torch.from_numpy(e["context_feature"][0]))
        print(f"identity drafter: max |hidden - expected.npz| = {(h - torch.from_numpy(e['draft_hidden'][0])).abs().max():.2e}")
        with open(os.path.join(REF, "greedy_cases.json")) as f:
            cases = json.load(f)
        for prompt, want_out, want_acc in zip(cases["prompts"], cases["outputs"], cases["acceptance_lengths"]):
            out = ident.generate(prompt, cases["max_new_tokens"])
            assert out["output_ids"] == want_out and out["acceptance_lengths"] == want_acc, (out, want_acc)
        print(f"identity DFlash2 drafter: all {len(cases['prompts'])} greedy_cases.json outputs and acceptance lengths match")


if __name__ == "__main__":
    sys.exit(_smoke())
