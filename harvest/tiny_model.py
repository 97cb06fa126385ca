"""Tiny, locally built models for tests and the CPU demo (there is no model hub here).

Each model is a byte-level BPE tokenizer trained on a fixed few-hundred-word corpus plus a
randomly initialised decoder (Llama, or a Qwen2-style variant with attention biases),
saved with ``save_pretrained`` so SGLang, transformers, PEFT and LlamaFactory load it like
any checkpoint. Building is deterministic (fixed seed, fixed corpus), takes a few
seconds, and happens once: the result is cached under ``<project>/.cache/tiny-models``
(or ``HARVEST_CACHE_DIR``), keyed by the builder version, and written atomically so
concurrent test processes never see half a model.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path

from harvest import config_env

# Bump when the corpus, tokenizer or model shapes change: old caches are then ignored.
BUILDER_VERSION = 1

CORPUS = """
harvest runs a small finetune job inside the idle compute and memory of a decode server.
the server answers requests one token at a time and every step must finish before the
target time per output token. when the batch is small the gpu has spare streaming
multiprocessors and spare key value cache memory, and the trainer borrows them.
the allocator lends whole chunks of the key value cache to the trainer and takes them
back before the decode batch grows. the scheduler predicts the latency of the next step
on each partition of the gpu and picks the one that keeps the step under its target.
the trainer runs one layer at a time, forward and then backward, and checks a gate
between units so that decode can pause it quickly. frozen weights move through a window
of borrowed memory while the adapter weights, their gradients and the optimizer state
stay resident. a profile measured offline gives the predictor its coefficients and the
predictor refines them online from the steps it observes. operators watch the latency,
the partition, the memory lent and the loss on a dashboard and replay their own traffic
to see where harvesting pays. the quick brown fox jumps over the lazy dog while the cat
sleeps in the sun and the bird sings a song about rivers, mountains, forests and the sea.
numbers like one two three four five six seven eight nine ten appear in many sentences.
questions ask what, why, where, when, who and how; answers explain, describe and compare.
a model reads text, writes text, learns from examples and forgets nothing it was not told.
""".strip()


@dataclasses.dataclass(frozen=True)
class TinyModelSpec:
    """Shape of one tiny model. Head dim = hidden_size / num_attention_heads."""

    family: str = "llama"  # "llama" or "qwen2"
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    seed: int = 0
    chat_tokens: bool = False  # also the special tokens of LlamaFactory's ChatML/Qwen and Llama-3 templates

    @property
    def special_tokens(self) -> list[str]:
        return _BASE_SPECIAL_TOKENS + (_CHAT_TEMPLATE_TOKENS if self.chat_tokens else [])

    @property
    def name(self) -> str:
        return (
            f"tiny-{self.family}-h{self.hidden_size}-l{self.num_hidden_layers}"
            f"-a{self.num_attention_heads}-kv{self.num_key_value_heads}-v{self.vocab_size}"
            f"-s{self.seed}{'-chat' if self.chat_tokens else ''}-b{BUILDER_VERSION}"
        )


_BASE_SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"]
# What LlamaFactory's qwen/qwen3/qwen3_nothink and llama3 templates write or stop on: a
# model whose vocabulary has them runs LlamaFactory's example job files unchanged.
_CHAT_TEMPLATE_TOKENS = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>",
                         "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]

TINY_LLAMA = TinyModelSpec(family="llama")
TINY_QWEN2 = TinyModelSpec(family="qwen2")
TINY_CHAT_LLAMA = TinyModelSpec(family="llama", chat_tokens=True)


def cache_dir() -> Path:
    return config_env.cache_dir() / "tiny-models"


def ensure_tiny_model(spec: TinyModelSpec = TINY_LLAMA) -> Path:
    """Return the directory of ``spec``'s checkpoint, building it on first use."""
    target = cache_dir() / spec.name
    if (target / "config.json").is_file() and (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=target.parent))
    try:
        _build(spec, staging)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process finished first; its copy is identical (deterministic build).
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(spec: TinyModelSpec, out_dir: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = spec.special_tokens
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        model_max_length=spec.max_position_embeddings,
    )
    # A minimal chat template so chat endpoints and LlamaFactory's templates work.
    hf_tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>{{ m['content'] }}"
        "{% else %}<|assistant|>{{ m['content'] }}<|eos|>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    hf_tokenizer.save_pretrained(out_dir)

    common = dict(
        vocab_size=len(hf_tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        bos_token_id=hf_tokenizer.bos_token_id,
        eos_token_id=hf_tokenizer.eos_token_id,
        pad_token_id=hf_tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    if spec.family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config, model_cls = LlamaConfig(**common), LlamaForCausalLM
    elif spec.family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config, model_cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        raise ValueError(f"TinyModelSpec.family: unknown family {spec.family!r} (llama or qwen2)")
    torch.manual_seed(spec.seed)
    model = model_cls(config)
    # Random init with std 0.02 makes logits nearly uniform and greedy decoding a
    # coin toss between near-ties; larger weights give decisive, reproducible argmaxes.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2)
    model.generation_config.do_sample = False
    model.save_pretrained(out_dir, safe_serialization=True)
