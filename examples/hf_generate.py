"""Greedy decoding of a Hugging Face Llama or Qwen3 model with ropekv writing its paged KV cache.

The model's own modules do everything but RoPE, the cache append and attention: per layer,
RMSNorm, the q/k/v projections, then one ropekv call that ropes q and k and appends k and v to a
paged cache (``rope_append_paged_kv_cache`` for Llama, ``qk_rmsnorm_rope_append_paged_kv_cache``
with the layer's ``q_norm`` / ``k_norm`` weights for Qwen3), attention over the pages (a plain
torch attention over the gathered pages, or FlashInfer's paged wrappers on the GPU), ``o_proj``
and the MLP. The RoPE table is ``ropekv.cos_sin_cache`` built from the config's ``rope_theta`` and
``rope_scaling`` (llama3 scaling included).

Run as a script to compare against ``transformers``' ``generate()``::

    python -m examples.hf_generate --arch llama            # a tiny random Llama (llama3 RoPE)
    python -m examples.hf_generate --arch qwen3 --cache bfloat16
    python -m examples.hf_generate --model /path/to/checkpoint --device cuda --attention flashinfer
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math

import numpy as np
import torch

import ropekv
from examples.paged_attention import PageTable, attention, gather, gather_scales

FP8 = torch.float8_e4m3fn
# unit roundoff of each cache dtype (half the spacing of values in [1, 2))
UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, FP8: 2.0**-4}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


def tiny_model(arch, seed=0, hidden=128, layers=2, vocab=256, head_dim=32):
    """A seeded random ``LlamaForCausalLM`` (llama3 ``rope_scaling``) or ``Qwen3ForCausalLM``
    (QK-norm) with 4 query heads and 2 KV heads of ``head_dim``, in float32 and eval mode."""
    import transformers

    common = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "max_position_embeddings": 256,
        "initializer_range": 0.1,  # logits with real margins, not the near-uniform ones of 0.02
        "eos_token_id": None,
        "bos_token_id": None,
        "pad_token_id": 0,
    }
    torch.manual_seed(seed)
    if arch == "llama":
        config = transformers.LlamaConfig(**common, rope_parameters=dict(LLAMA3_ROPE))
        model = transformers.LlamaForCausalLM(config)
    elif arch == "qwen3":
        config = transformers.Qwen3Config(**common, rope_parameters={"rope_theta": 1e6})
        model = transformers.Qwen3ForCausalLM(config)
    else:
        raise ValueError(f"arch must be 'llama' or 'qwen3', got {arch!r}")
    return model.float().eval()


def rope_of(config):
    """``(rope_theta, rope_scaling dict or None)`` of a config (transformers 4 or 5 spelling)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    params = dict(params or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), (None if kind == "default" else params)


class FlashInferAttention:
    """FlashInfer's paged decode / prefill wrappers over the caches ropekv writes, planned once
    per step and run by every layer."""

    def __init__(self, heads, kv_heads, head_dim, page_size, kv_layout, kv_dtype, sm_scale, device):
        import flashinfer

        def workspace():
            return torch.zeros(128 << 20, dtype=torch.uint8, device=device)

        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace(), kv_layout)
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace(), kv_layout, backend="fa2"
        )
        self.shape = (heads, kv_heads, head_dim, page_size)
        self.kv_dtype, self.sm_scale = kv_dtype, sm_scale
        self.token_head_sf = kv_dtype == FP8  # fp8 caches carry ropekv's per-token-head scales
        self.wrapper = None

    def plan(self, table, lengths, new_lengths, q_dtype):
        indices, indptr, last = table.csr(lengths, device=self.decode.device)
        common = {
            "q_data_type": q_dtype,
            "kv_data_type": self.kv_dtype,
            "sm_scale": self.sm_scale,
            "use_token_head_sf": self.token_head_sf,
        }
        if all(n == 1 for n in new_lengths):
            self.decode.plan(indptr, indices, last, *self.shape, **common)
            self.wrapper = self.decode
        else:
            qo = torch.tensor(np.cumsum([0, *new_lengths]), dtype=torch.int32, device=indptr.device)
            self.prefill.plan(qo, indptr, indices, last, *self.shape, causal=True, **common)
            self.wrapper = self.prefill

    def __call__(self, q, caches, scales):
        sf = {"kv_cache_sf": scales} if self.token_head_sf else {}
        return self.wrapper.run(q, caches, **sf)


class PagedDecoder:
    """A transformers causal LM run layer by layer over ropekv-written paged caches.

    ``cache`` is the cache dtype: float16 / bfloat16 (q, k and v enter ropekv in it) or
    float8_e4m3fn (q, k, v enter in float16; the cache carries per-token-head scales
    ``kv_cache_scales``, which FlashInfer reads with ``use_token_head_sf=True``).
    """

    def __init__(
        self,
        model,
        capacities,
        *,
        cache=torch.float16,
        page_size=16,
        kv_layout="NHD",
        attention="torch",
        seed=0,
    ):
        self.model, self.config = model, model.config
        cfg = self.config
        self.device = next(model.parameters()).device
        self.compute_dtype = next(model.parameters()).dtype
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
        self.cache_dtype = cache
        self.input_dtype = torch.float16 if cache == FP8 else cache  # what ropekv reads
        self.page_size, self.kv_layout = page_size, kv_layout
        self.table = PageTable(capacities, page_size, seed=seed)
        self.lengths = [0] * len(capacities)
        layers = model.model.layers
        self.qk_norm = hasattr(layers[0].self_attn, "q_norm")
        self.sm_scale = layers[0].self_attn.scaling
        theta, scaling = rope_of(cfg)
        rows = max(capacities)
        table = ropekv.cos_sin_cache(rows, self.head_dim, base=theta, scaling=scaling)
        self.cos_sin = torch.from_numpy(table).to(self.device)

        H, D, P = self.kv_heads, self.head_dim, self.table.num_pages
        shape = (P, page_size, H, D) if kv_layout == "NHD" else (P, H, page_size, D)
        # fp8 caches are allocated as bytes and viewed (torch fills fp8 on every device this way)
        self.caches = [
            tuple(torch.zeros(shape, dtype=torch.uint8 if cache == FP8 else cache,
                              device=self.device).view(cache) for _ in range(2))
            for _ in layers
        ]  # fmt: skip
        self.scales = [
            tuple(torch.zeros(shape[:-1], device=self.device) for _ in range(2)) if cache == FP8
            else None
            for _ in layers
        ]  # fmt: skip
        pages = self.table.pages
        self.kv_indices = torch.from_numpy(np.concatenate(pages).astype(np.int32)).to(self.device)
        indptr = np.concatenate([[0], np.cumsum([len(p) for p in pages])]).astype(np.int32)
        self.kv_indptr = torch.from_numpy(indptr).to(self.device)
        self.block_table = self.table.block_table(self.device)
        self.flashinfer = None
        if attention == "flashinfer":
            self.flashinfer = FlashInferAttention(
                self.heads, H, D, page_size, kv_layout, cache, self.sm_scale, self.device
            )
        elif attention != "torch":
            raise ValueError(f"attention must be 'torch' or 'flashinfer', got {attention!r}")

    # ---- one layer's RoPE + cache append: the ropekv call ----
    def rope_append(self, i, q, k, v, step):
        kc, vc = self.caches[i]
        scales = self.scales[i]
        if self.qk_norm:
            attn = self.model.model.layers[i].self_attn
            return ropekv.qk_rmsnorm_rope_append_paged_kv_cache(
                q, k, v, attn.q_norm.weight.float(), attn.k_norm.weight.float(), self.cos_sin,
                step["offsets"], step["cache_lengths"], self.block_table, (kc, vc),
                epsilon=attn.q_norm.variance_epsilon, kv_layout=self.kv_layout,
                kv_cache_scales=scales,
            )  # fmt: skip
        if scales is None:
            q_out, _ = ropekv.rope_append_paged_kv_cache(
                q, k, None, None, v, self.cos_sin, step["positions"], (kc, vc),
                self.kv_indices, self.kv_indptr, step["batch"], step["positions"],
                page_size=self.page_size, kv_layout=self.kv_layout,
            )  # fmt: skip
            return q_out
        # fp8: q too comes out in fp8, with one dequantization scale per token and head
        q_scale = torch.empty(q.shape[:2], device=self.device)
        q8, _ = ropekv.rope_append_paged_kv_cache(
            q, k, None, None, v, self.cos_sin, step["positions"], (kc, vc),
            self.kv_indices, self.kv_indptr, step["batch"], step["positions"],
            page_size=self.page_size, kv_layout=self.kv_layout, q_scale_out=q_scale,
            kv_cache_scales=scales,
        )  # fmt: skip
        return (q8.float() * q_scale[..., None]).to(self.input_dtype)

    def attend(self, i, q, step):
        if self.flashinfer is not None:
            return self.flashinfer(q, self.caches[i], self.scales[i])
        out = []
        for b, (start, stop) in enumerate(step["spans"]):
            if start == stop:
                continue
            rows = [
                gather(c, self.table.pages[b], self.lengths[b], self.page_size, self.kv_layout)
                for c in self.caches[i]
            ]
            k, v = (r.float() for r in rows)
            if self.scales[i] is not None:
                ks, vs = (
                    gather_scales(s, self.table.pages[b], self.lengths[b], self.page_size,
                                  self.kv_layout)
                    for s in self.scales[i]
                )  # fmt: skip
                k, v = k * ks[..., None], v * vs[..., None]
            pos = step["positions"][start:stop].long()
            out.append(attention(q[start:stop].float(), k, v, self.sm_scale, pos))
        return torch.cat(out)

    @torch.no_grad()
    def step(self, new_tokens):
        """Append ``new_tokens[b]`` (a list of ids, maybe empty) to each request; returns the
        float32 logits ``(B, vocab)`` after each request's last new token."""
        model, dev = self.model, self.device
        new_lengths = [len(t) for t in new_tokens]
        cache_lengths = list(self.lengths)
        batch, positions = self.table.append_indices(cache_lengths, new_lengths, dev)
        offsets = np.concatenate([[0], np.cumsum(new_lengths)]).astype(np.int32)
        step = {
            "batch": batch,
            "positions": positions,
            "offsets": torch.from_numpy(offsets).to(dev),
            "cache_lengths": torch.tensor(cache_lengths, dtype=torch.int32, device=dev),
            "spans": list(itertools.pairwise(offsets)),
        }
        ids = torch.tensor([t for ts in new_tokens for t in ts], dtype=torch.long, device=dev)
        T, H, Hkv, D = len(ids), self.heads, self.kv_heads, self.head_dim
        self.lengths = [c + n for c, n in zip(cache_lengths, new_lengths)]
        if self.flashinfer is not None:
            self.flashinfer.plan(self.table, self.lengths, new_lengths, self.input_dtype)
        x = model.model.embed_tokens(ids)
        for i, layer in enumerate(model.model.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            q = a.q_proj(h).view(T, H, D).to(self.input_dtype)
            k = a.k_proj(h).view(T, Hkv, D).to(self.input_dtype)
            v = a.v_proj(h).view(T, Hkv, D).to(self.input_dtype)
            q = self.rope_append(i, q, k, v, step)
            o = self.attend(i, q, step)
            x = x + a.o_proj(o.reshape(T, H * D).to(self.compute_dtype))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = torch.tensor([stop - 1 for start, stop in step["spans"]], device=dev)
        return model.lm_head(model.model.norm(x[last])).float()

    def teacher_forced(self, prompts, continuations):
        """Logits ``(B, steps, vocab)``: after each prompt (one ragged prefill), then after each
        token of ``continuations[b]`` but its last, fed one decode step at a time."""
        steps = [self.step(prompts)]
        for s in range(len(continuations[0]) - 1):
            steps.append(self.step([[c[s]] for c in continuations]))
        return torch.stack(steps, dim=1)


@torch.no_grad()
def hf_greedy(model, prompt, new_tokens):
    """transformers' ``generate()``: the greedy continuation and its per-step float32 logits."""
    ids = torch.tensor([prompt], device=next(model.parameters()).device)
    out = model.generate(
        ids,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


@torch.no_grad()
def logit_noise(model, sequences, prompt_lengths, dtype):
    """How far running ``model`` itself in ``dtype`` moves its logits: the largest
    ``|logits(dtype) - logits(float32)|`` over the steps of ``sequences`` (teacher-forced)."""
    half = copy.deepcopy(model).to(dtype)
    worst = 0.0
    for seq, n in zip(sequences, prompt_lengths):
        ids = torch.tensor([seq], device=next(model.parameters()).device)
        a = model(ids).logits[0, n - 1 : -1].float()
        b = half(ids).logits[0, n - 1 : -1].float()
        worst = max(worst, (a - b).abs().max().item())
    return worst


def compare(model, prompts, new_tokens, **decoder_options):
    """Greedy-decode ``prompts`` with transformers and, teacher-forced on its tokens, with ropekv
    (:class:`PagedDecoder`); returns a dict of the logits, tokens and the derived tolerance.

    The tolerance: ropekv's loop computes like the float32 model except that q, k and v are
    rounded to the cache dtype around RoPE (two roundings of q and k, one of v, each of relative
    size at most u, the dtype's unit roundoff). Running the whole model in a 16-bit dtype rounds
    those same values and every other activation and weight as well, so its logit change
    (:func:`logit_noise`, measured on these sequences) is the scale of rounding error this model
    turns into logit error; scaled from that dtype's u to the cache's u (first order: logit
    error grows linearly in u), it is the tolerance.
    """
    hf = [hf_greedy(model, p, new_tokens) for p in prompts]
    tokens = [t for t, _ in hf]
    expected = torch.stack([lg for _, lg in hf])
    capacities = [len(p) + new_tokens for p in prompts]
    decoder = PagedDecoder(model, capacities, **decoder_options)
    got = decoder.teacher_forced(prompts, tokens)
    reference_dtype = decoder.input_dtype  # a 16-bit dtype (float16 for fp8 caches)
    noise = logit_noise(
        model, [p + t for p, t in zip(prompts, tokens)], [len(p) for p in prompts],
        reference_dtype,
    )  # fmt: skip
    tol = noise * UNIT_ROUNDOFF[decoder.cache_dtype] / UNIT_ROUNDOFF[reference_dtype]
    top2 = expected.topk(2, dim=-1).values
    margin = top2[..., 0] - top2[..., 1]
    return {
        "expected": expected,
        "got": got.to(expected.device),
        "tokens": torch.tensor(tokens, device=expected.device),
        "margin": margin,
        "tol": tol,
    }


def summary(result):
    err = (result["got"] - result["expected"]).abs().amax(dim=-1)
    decided = result["margin"] > 2 * result["tol"]
    agree = result["got"].argmax(-1) == result["tokens"]
    return (
        f"max |logit error| {err.max().item():.3g} (tolerance {result['tol']:.3g}); greedy "
        f"tokens agree at {int((agree & decided).sum())} of {int(decided.sum())} steps whose "
        f"top-2 margin exceeds twice the tolerance ({int(agree.sum())} of {agree.numel()} in all)"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=("llama", "qwen3"), default="llama")
    parser.add_argument("--model", help="a local Llama / Qwen3 checkpoint (instead of --arch)")
    parser.add_argument(
        "--cache", default="float16", choices=("float16", "bfloat16", "float8_e4m3fn")
    )
    parser.add_argument("--layout", default="NHD", choices=("NHD", "HND"))
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--attention", default="torch", choices=("torch", "flashinfer"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--new-tokens", type=int, default=8)
    args = parser.parse_args(argv)
    if args.model:
        import transformers

        model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        model.generation_config.eos_token_id = None
    else:
        model = tiny_model(args.arch)
    model = model.to(args.device).eval()
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(1, vocab, n).tolist() for n in (5, 12, 1)]
    result = compare(
        model, prompts, args.new_tokens, cache=getattr(torch, args.cache),
        page_size=args.page_size, kv_layout=args.layout, attention=args.attention,
    )  # fmt: skip
    print(summary(result))
    bad = (result["got"] - result["expected"]).abs().max().item() > result["tol"]
    return 1 if bad or math.isnan(result["tol"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
