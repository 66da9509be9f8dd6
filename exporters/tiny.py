"""Tiny random-weight checkpoints built from configs: for tests, smoke runs and CI.

Nothing here downloads anything. `make_tiny_target` writes a Hugging Face folder (config, seeded
random weights, a byte-level BPE tokenizer trained on a fixed text, a chat template and a generation
config) that `dflash export` reads like any hub checkpoint. The draft side lives in
`exporters/draft_checkpoint.py` (`make_tiny_draft`), since it writes the draft checkpoint format.
"""

from __future__ import annotations

from pathlib import Path

# Special tokens of the tiny tokenizer, in id order right after the 256 byte tokens' merges start.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
EOS_TOKEN = "<|im_end|>"

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A fixed corpus, so that the trained merges (and so every token id) are the same on every machine.
_CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "The quick brown fox jumps over the lazy dog.",
    "Speculative decoding drafts several tokens and the target model verifies them in one pass.",
    "for i in range(10):\n    print(i * i)\n",
    "Hello, world! How are you today? I am fine, thank you.",
    "import numpy as np\nx = np.arange(16).reshape(4, 4)\n",
    "OpenVINO runs models on Intel CPUs, GPUs and NPUs.",
]

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "qwen3_5_text")

# Hybrid linear-attention families (GatedDeltaNet layers with a full-attention layer every few layers).
# optimum-intel 2.2.0 exports `qwen3_5_text` only under transformers 5.2.x (its export config caps the
# version at 5.2.99); see docs/hybrid-targets.md.
HYBRID_FAMILIES = ("qwen3_5_text",)

# Small linear-attention sizes for the tiny hybrid target (the real model: 16 key / 32 value heads of 128).
_TINY_LINEAR_ATTENTION = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    # Three GatedDeltaNet layers, then full attention: Qwen3.5's own pattern (full_attention_interval 4).
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
)


# The tiny vision-language Qwen3.5 (`qwen3_5`, the published layout): a vision tower as small as its config
# allows (the text target leaves it out) and the published rotary layout (interleaved M-RoPE over a quarter
# of head_dim; Qwen3.5-9B: sections [11, 11, 10] of 32 frequencies) scaled to head_dim 16.
_TINY_VISION = dict(
    depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
    temporal_patch_size=2, num_position_embeddings=16,
)
_TINY_MROPE = dict(
    rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[1, 1, 0], mrope_interleaved=True
)


def _tiny_config_kwargs(vocab_size: int, **overrides) -> dict:
    base = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.05,
    )
    base.update(overrides)
    return base


def build_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer trained on a fixed corpus, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def make_tiny_target(
    path: str | Path,
    family: str = "qwen3",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    **config_overrides,
) -> Path:
    """Write a tiny random-weight causal LM of `family` (one of FAMILIES) to `path`.

    `qwen3_5_text` is the hybrid Qwen3.5 text model (3 GatedDeltaNet layers + 1 full-attention layer
    unless `layer_types`/`num_hidden_layers` say otherwise); it needs transformers >= 5.2.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    kwargs = _tiny_config_kwargs(
        vocab_size, eos_token_id=eos_id, bos_token_id=pad_id, pad_token_id=pad_id, **config_overrides
    )
    if family == "llama":
        kwargs.setdefault("attention_bias", False)
    if family in HYBRID_FAMILIES:
        for key, value in _TINY_LINEAR_ATTENTION.items():
            kwargs.setdefault(key, value)
    config = AutoConfig.for_model(family, **kwargs)

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    model.eval()
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=pad_id, do_sample=False
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_vlm_target(
    path: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    tie_word_embeddings: bool = False,
    **text_overrides,
) -> Path:
    """Write a tiny random-weight vision-language Qwen3.5 checkpoint (`qwen3_5`) to `path`.

    Laid out as Qwen3.5 is published: `Qwen3_5ForConditionalGeneration`, the language model (the tiny
    `qwen3_5_text` sizes, `text_overrides` on top) in `text_config` with its weights under
    `model.language_model.*`, a one-block vision tower under `model.visual.*`, `tie_word_embeddings` at
    the top level (where the VLM reads it; `lm_head.weight` is then not saved). The image/video token
    ids lie past the vocabulary, so no text token is one. Needs transformers >= 5.2.
    """
    import torch
    from transformers import GenerationConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    text = _tiny_config_kwargs(vocab_size, eos_token_id=eos_id, bos_token_id=pad_id, pad_token_id=pad_id)
    text.update(_TINY_LINEAR_ATTENTION, rope_parameters=dict(_TINY_MROPE), tie_word_embeddings=tie_word_embeddings)
    text.pop("rope_theta")
    text.update(text_overrides)
    vision = dict(_TINY_VISION, out_hidden_size=text["hidden_size"])
    special = dict(zip(("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"), range(vocab_size, vocab_size + 4)))
    config = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=tie_word_embeddings, **special)

    torch.manual_seed(seed)
    model = Qwen3_5ForConditionalGeneration(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=pad_id, do_sample=False)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
