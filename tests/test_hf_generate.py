"""End to end against Hugging Face: transformers' own Llama (llama3 rope_scaling) and Qwen3
(QK-norm) models, greedy-decoded by ``generate()`` and, teacher-forced on its tokens, by
``examples/hf_generate.py``'s loop in which ropekv ropes q/k and writes every layer's paged KV cache
and attention reads the pages back. Per step the logits agree within the tolerance derived in
``examples.hf_generate.compare`` and the greedy tokens agree wherever the top-2 margin exceeds
twice it (the CPU tests run ropekv's NumPy backend; the GPU ones its kernels and FlashInfer)."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="the Hugging Face tests need transformers")

from examples import hf_generate

PROMPT_LENGTHS = (5, 12, 1)  # a ragged batch, one request decoding from a single-token prompt
NEW_TOKENS = 6


def prompts(vocab, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, n).tolist() for n in PROMPT_LENGTHS]


def check(result):
    err = (result["got"] - result["expected"]).abs().amax(dim=-1)  # (B, steps)
    assert result["tol"] > 0
    assert err.max().item() <= result["tol"], hf_generate.summary(result)
    decided = result["margin"] > 2 * result["tol"]
    agree = result["got"].argmax(-1) == result["tokens"]
    assert bool(agree[decided].all()), hf_generate.summary(result)
    return decided


@pytest.mark.parametrize(
    "arch, cache, layout, page_size",
    [
        ("llama", torch.float16, "NHD", 4),
        ("llama", torch.bfloat16, "HND", 16),
        ("qwen3", torch.float16, "HND", 1),
        ("qwen3", torch.bfloat16, "NHD", 16),
        ("llama", torch.float8_e4m3fn, "NHD", 16),
        ("qwen3", torch.float8_e4m3fn, "HND", 4),
    ],
)
def test_logits_match_transformers_on_the_cpu(arch, cache, layout, page_size):
    model = hf_generate.tiny_model(arch)
    result = hf_generate.compare(
        model, prompts(model.config.vocab_size), NEW_TOKENS, cache=cache, kv_layout=layout,
        page_size=page_size,
    )  # fmt: skip
    decided = check(result)
    if cache != torch.float8_e4m3fn:  # fp8's tolerance is 128 times fp16's: few margins beat it
        assert decided.float().mean() >= 0.5, hf_generate.summary(result)


def test_the_comparison_catches_a_rope_table_without_llama3_scaling(monkeypatch):
    """The tolerance is tight enough to fail: the same loop with an unscaled RoPE table (what
    ignoring the config's rope_scaling would give) misses transformers' logits."""
    model = hf_generate.tiny_model("llama")
    monkeypatch.setattr(hf_generate, "rope_of", lambda config: (500000.0, None))
    result = hf_generate.compare(model, prompts(model.config.vocab_size), NEW_TOKENS)
    err = (result["got"] - result["expected"]).abs().max().item()
    assert err > 10 * result["tol"], hf_generate.summary(result)


def test_the_script_runs():
    assert hf_generate.main(["--arch", "qwen3", "--new-tokens", "3"]) == 0


def flashinfer_or_skip():
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not installed: the GPU decode loop attends with it")


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize(
    "cache, layout, page_size",
    [(torch.float16, "NHD", 16), (torch.float16, "HND", 1), (torch.float8_e4m3fn, "HND", 16)],
)
def test_logits_match_transformers_with_flashinfer(arch, cache, layout, page_size):
    """ropekv's CUDA kernels write the caches (fp8: with per-token-head scales) and FlashInfer's
    paged prefill / decode wrappers read them, inside transformers' model on the GPU."""
    flashinfer_or_skip()
    # head dim 128: the FlashInfer modules the read-back tests build too
    model = hf_generate.tiny_model(arch, head_dim=128).to("cuda")
    result = hf_generate.compare(
        model, prompts(model.config.vocab_size), NEW_TOKENS, cache=cache, kv_layout=layout,
        page_size=page_size, attention="flashinfer",
    )  # fmt: skip
    check(result)
