"""A GPT-2-style Hugging Face model built from its config (no download), for the tests, the
end-to-end CLI check and ``benchmarks/validate_gpu.py``.

``transformers`` is imported inside the functions, so importing this module is cheap::

    dptune search --model dptune.examples.hf:tiny_gpt2 --sample dptune.examples.hf:gpt2_batch \\
        --batch-size 32 --simulate 2x24GB --amp bf16 --accumulate 2

The model returns a ``CausalLMOutputWithCrossAttentions`` with ``loss``, ``logits`` and, as
``use_cache`` defaults to on, ``past_key_values`` (a ``DynamicCache``), which DataParallel
gathers onto card 0 although the loss never reads it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["tiny_gpt2", "gpt2_small", "gpt2_batch", "SEQ_LEN", "VOCAB_SIZE"]

SEQ_LEN = 64
VOCAB_SIZE = 1000


def tiny_gpt2(n_layer: int = 2, n_embd: int = 64, n_head: int = 4, vocab_size: int = VOCAB_SIZE,
              n_positions: int = 256, use_cache: bool = True) -> Any:
    """``GPT2LMHeadModel`` from a small ``GPT2Config`` (random weights, no dropout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=vocab_size,
                        n_positions=n_positions, use_cache=use_cache, bos_token_id=0,
                        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"      # the default, said explicitly (else transformers warns)
    return model


def gpt2_small(use_cache: bool = True) -> Any:
    """GPT-2 small's shape (124M parameters), random weights."""
    return tiny_gpt2(n_layer=12, n_embd=768, n_head=12, vocab_size=50257, n_positions=1024,
                     use_cache=use_cache)


def gpt2_batch(batch_size: int, seq_len: int = SEQ_LEN, vocab_size: int = VOCAB_SIZE) -> dict:
    """``{"input_ids", "labels"}`` of ``(batch_size, seq_len)`` token ids: the model computes
    its own loss."""
    import torch

    ids = torch.randint(0, vocab_size, (batch_size, seq_len))
    return {"input_ids": ids, "labels": ids.clone()}
