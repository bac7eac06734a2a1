"""Tiny models and a local tokenizer, built from scratch, for tests, the demo and benchmarks.

Nothing here downloads anything: the tokenizer is a byte-level BPE trained with the ``tokenizers``
library on a small built-in corpus, and the models are randomly initialised from transformers
configs. Both are written with ``save_pretrained`` so that everything downstream loads them through
the same ``from_pretrained`` path a user's local model directory takes.

    >>> from mlora_lab.tiny import build_tiny_model
    >>> path = build_tiny_model("llama", "/tmp/tiny-llama")   # model + tokenizer in one directory
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from mlora_lab.bases import no_progress_bars

PAD, BOS, EOS = "<pad>", "<s>", "</s>"

# A ChatML-like template; the assistant's turn ends with EOS so a tuned adapter learns to stop.
# Tool-capable, Hermes/Qwen style, as TRL's tool loop expects: with ``tools`` a first system block
# lists them (after the system message's content, which then gets no block of its own); an
# assistant's ``tool_calls`` follow its content as ``<tool_call>{"name": .., "arguments": ..}</tool_call>``
# (arguments: a dict goes through tojson, a JSON string as is); a tool result is a ``<|tool|>`` turn.
# Without tools, tool calls or None contents it renders byte for byte what the first version did.
# No newline follows a ``%}`` (trim_blocks would eat it): newlines there are ``{{ '\\n' }}``.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set tools_in_system = tools and messages and messages[0]['role'] == 'system' %}"
    "{% if tools %}<|system|>\n"
    "{% if tools_in_system and messages[0]['content'] %}{{ messages[0]['content'] }}{{ '\\n\\n' }}{% endif %}"
    "You can call these tools:\n<tools>\n{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}"
    '</tools>\nTo call one, answer <tool_call>{"name": ..., "arguments": {...}}</tool_call>\n'
    "{% endif %}"
    "{% for m in messages %}{% if not (loop.first and tools_in_system) %}"
    "<|{{ m['role'] }}|>\n{% if m['content'] is not none %}{{ m['content'] }}{% endif %}"
    "{% if m['role'] == 'assistant' %}"
    "{% for c in m['tool_calls'] or [] %}{% set f = c['function'] if c['function'] is defined else c %}"
    '<tool_call>{"name": {{ f[\'name\'] | tojson }}, "arguments": '
    "{% if f['arguments'] is not defined or f['arguments'] is none %}{{ '{}' }}"
    "{% elif f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "{{ '}' }}</tool_call>{% endfor %}"
    "{{ eos_token }}{% endif %}{{ '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = [
    "the",
    "a",
    "an",
    "and",
    "or",
    "but",
    "if",
    "then",
    "else",
    "when",
    "while",
    "for",
    "to",
    "of",
    "in",
    "on",
    "at",
    "by",
    "with",
    "from",
    "into",
    "over",
    "under",
    "model",
    "adapter",
    "tenant",
    "train",
    "loss",
    "rank",
    "alpha",
    "learning",
    "rate",
    "batch",
    "step",
    "token",
    "data",
    "base",
    "frozen",
    "question",
    "answer",
    "reverse",
    "upper",
    "lower",
    "copy",
    "sort",
    "count",
    "add",
    "sum",
    "number",
    "letter",
    "word",
    "sentence",
    "red",
    "green",
    "blue",
    "yellow",
    "cat",
    "dog",
    "bird",
    "fish",
    "tree",
    "river",
    "mountain",
    "city",
    "house",
    "road",
    "car",
    "train",
    "plane",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "zero",
    "hello",
    "world",
    "please",
    "thanks",
    "yes",
    "no",
    "user",
    "assistant",
    "system",
    "what",
    "which",
    "who",
    "why",
    "how",
    "is",
    "are",
    "was",
    "were",
    "be",
    "been",
    "do",
    "does",
    "did",
    "can",
    "will",
]


def default_corpus() -> list[str]:
    """Deterministic text that covers letters, digits, punctuation and common words."""
    lines = [" ".join(_WORDS[i : i + 12]) for i in range(0, len(_WORDS), 6)]
    lines += [" ".join(str(n) for n in range(k, k + 20)) for k in range(0, 200, 10)]
    lines += ["".join(chr(c) for c in range(32, 127))]
    lines += [f"{w.upper()} {w.capitalize()} {w[::-1]}: {w}, {w}! {w}?" for w in _WORDS]
    return lines


def build_tokenizer(
    out_dir: str | Path | None = None, corpus: Iterable[str] | None = None, vocab_size: int = 512
) -> transformers.PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (so every string is encodable) with BOS/EOS/PAD and a chat template.

    Token ids: 0 = ``<pad>``, 1 = ``<s>`` (prepended by ``add_special_tokens=True``), 2 = ``</s>``.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) if corpus is not None else default_corpus(), trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="right"
    )
    fast.chat_template = CHAT_TEMPLATE
    if out_dir is not None:
        fast.save_pretrained(str(out_dir))
    return fast


def _common(vocab_size: int, hidden: int, layers: int, heads: int, kv_heads: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )


def _llama(**kw: Any) -> transformers.PretrainedConfig:
    return transformers.LlamaConfig(**_common(**kw))


def _qwen2(**kw: Any) -> transformers.PretrainedConfig:
    return transformers.Qwen2Config(**_common(**kw))


def _phi3(**kw: Any) -> transformers.PretrainedConfig:
    # Fused projections: self_attn.qkv_proj and mlp.gate_up_proj are single nn.Linear layers.
    return transformers.Phi3Config(**_common(**kw))


def _gpt_neox(**kw: Any) -> transformers.PretrainedConfig:
    # Fused attention projection: attention.query_key_value.
    c = _common(**kw)
    c.pop("num_key_value_heads")
    return transformers.GPTNeoXConfig(**c, rotary_pct=0.5, use_parallel_residual=True)


def _qwen3_moe(experts: int = 4, **kw: Any) -> transformers.PretrainedConfig:
    # Packed experts: mlp.experts.gate_up_proj [E, 2I, H] and mlp.experts.down_proj [E, H, I].
    c = _common(**kw)
    return transformers.Qwen3MoeConfig(
        **c,
        num_experts=experts,
        num_experts_per_tok=2,
        moe_intermediate_size=c["hidden_size"] // 2,
        decoder_sparse_step=1,
    )


def _mixtral(experts: int = 4, **kw: Any) -> transformers.PretrainedConfig:
    c = _common(**kw)
    return transformers.MixtralConfig(
        **{**c, "intermediate_size": c["hidden_size"] // 2}, num_local_experts=experts, num_experts_per_tok=2
    )


# name -> config factory(vocab_size, hidden, layers, heads, kv_heads); the table the fidelity tests run over.
ARCHITECTURES: dict[str, Callable[..., transformers.PretrainedConfig]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "phi3": _phi3,
    "gpt_neox": _gpt_neox,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
}

MOE_ARCHITECTURES = ["qwen3_moe", "mixtral"]

# Packed expert parameters a MoE tenant targets (PEFT target_parameters).
EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]

# The linear layers a typical tenant targets in each architecture (attention + MLP projections).
TYPICAL_TARGETS: dict[str, list[str]] = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "qwen3_moe": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mixtral": ["q_proj", "k_proj", "v_proj", "o_proj"],
}


def tiny_config(
    arch: str,
    vocab_size: int,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    experts: int | None = None,
) -> transformers.PretrainedConfig:
    """A transformers config of architecture ``arch`` (a key of :data:`ARCHITECTURES`); ``experts``
    sets the number of experts of a MoE architecture (default 4)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; known: {sorted(ARCHITECTURES)}")
    extra = {"experts": experts} if experts is not None else {}
    if extra and arch not in MOE_ARCHITECTURES:
        raise ValueError(f"{arch} has no experts; MoE architectures: {MOE_ARCHITECTURES}")
    return ARCHITECTURES[arch](
        vocab_size=vocab_size, hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, **extra
    )


def build_tiny_model(
    arch: str,
    out_dir: str | Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    experts: int | None = None,
) -> str:
    """Build a randomly initialised causal LM and a local tokenizer, save both to ``out_dir``.

    Returns ``out_dir`` as a string, ready for ``AutoModelForCausalLM.from_pretrained``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, corpus=corpus, vocab_size=vocab_size)
    config = tiny_config(
        arch, len(tok), hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads, experts=experts
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Random init leaves some weights at exactly 0/1 (norms, biases); jitter them so tests that
    # compare logits are sensitive to every parameter.
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    with no_progress_bars():
        model.save_pretrained(str(out))
    return str(out)
