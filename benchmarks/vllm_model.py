"""A tiny randomly initialised Llama built locally (no downloads), for the vLLM
plug-in's end-to-end tests and the TTFT benchmark.

Needs ``transformers`` and ``tokenizers`` (installed with vLLM). The weights are
seeded, so every build of one ``TinyLlama`` is the same model.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = 1024


@dataclass(frozen=True)
class TinyLlama:
    """Shape of the model: 2 layers, 2 KV heads of 32 dims: 64 KiB of KV per
    128-token block in bfloat16."""

    hidden: int = 128
    intermediate: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 32
    max_positions: int = 4096
    init_std: float = 0.2  # larger than HF's 0.02: outputs depend strongly on the KV
    seed: int = 0


def build_tiny_llama(directory: str | os.PathLike[str], shape: TinyLlama = TinyLlama()) -> Path:
    """Writes the model (safetensors, config, tokenizer) into ``directory``; returns it."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_positions,
        initializer_range=shape.init_std,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(shape.seed)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    (path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    return path


def random_prompt(num_tokens: int, seed: int) -> list[int]:
    """``num_tokens`` token ids (no special tokens), the same for one seed."""
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(num_tokens)]


def llm_kwargs(model: str | os.PathLike[str], kv_transfer_config: Any = None) -> dict[str, Any]:
    """``vllm.LLM`` arguments that run the tiny model on a 2-core CPU machine."""
    kwargs: dict[str, Any] = {
        "model": str(model),
        "dtype": "bfloat16",
        "max_model_len": 2048,
        "enforce_eager": True,
        "enable_prefix_caching": True,
        "max_num_seqs": 4,
        "kv_cache_memory_bytes": 128 << 20,
        "disable_log_stats": False,
        "seed": 0,
    }
    if kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = kv_transfer_config
    return kwargs
