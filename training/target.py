"""The frozen target during training: loading it, reading its features, choosing the mask token.

The draft never owns an embedding or an lm_head: it reads the target's (frozen) embedding for its
block rows and the target's lm_head for its logits, and its context rows are the target's hidden states
at `target_layer_ids`. HF convention: layer L's output is `hidden_states[L + 1]` (index 0 is the
embedding output; the last entry is post-final-norm, so the last layer is never a feature layer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from dflash.core.errors import InputError, ModelFormatError

# Names a tokenizer may give a dedicated mask token, checked in this order.
MASK_TOKEN_NAMES = ("<|mask|>", "<mask>", "[MASK]", "<|MASK|>")


@dataclass
class Target:
    """A loaded, frozen target: the causal LM, its tokenizer and the facts the trainer needs."""

    model: Any  # transformers PreTrainedModel (causal LM)
    tokenizer: Any
    path: Path
    num_layers: int
    hidden_size: int
    vocab_size: int
    device: torch.device
    dtype: torch.dtype

    @property
    def config(self) -> Any:
        return self.model.config

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """The target's input embedding of `token_ids` (frozen)."""
        return self.model.get_input_embeddings()(token_ids)

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's output projection of draft hidden states (frozen weights, gradients flow through)."""
        return self.model.get_output_embeddings()(hidden)


def resolve_device(device: str | None) -> torch.device:
    """`cuda`, `cpu` or None (cuda when available); a cuda request on a machine without one is an InputError."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu") and not device.startswith("cuda:"):
        raise InputError(f"unknown device {device!r}", hint="use --device cuda or --device cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for but torch sees no CUDA device", hint="use --device cpu")
    return torch.device(device)


def load_target(path: str | Path, device: torch.device, *, trust_remote_code: bool = False) -> Target:
    """Load the causal LM in `path` (bf16 on cuda, fp32 on cpu), frozen, in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash.exporters.staging import quiet_libraries

    path = Path(path)
    if not (path / "config.json").is_file():
        raise InputError(f"no config.json in {path}", hint="pass the target's local Hugging Face folder")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        with quiet_libraries():  # transformers' weight-loading bar and notes: not dflash's progress
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelFormatError(
            f"cannot load the target in {path}: {exc}".splitlines()[0],
            hint="the target must be a Hugging Face causal LM folder with its tokenizer",
        ) from exc
    model.to(device).eval().requires_grad_(False)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return Target(
        model=model,
        tokenizer=tokenizer,
        path=path,
        num_layers=int(config.num_hidden_layers),
        hidden_size=int(config.hidden_size),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        device=device,
        dtype=dtype,
    )


@torch.no_grad()
def target_features(target: Target, input_ids: torch.Tensor, layer_ids: Sequence[int]) -> torch.Tensor:
    """[N, T] right-padded token ids -> [N, T, k*H]: the outputs of `layer_ids`, concatenated in that order.

    Right padding needs no attention mask: a causal model's real positions never see the pads after them.
    Only the decoder stack runs (no logits over the whole sequence).
    """
    outputs = target.model.base_model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    hidden = outputs.hidden_states
    return torch.cat([hidden[layer + 1] for layer in layer_ids], dim=-1)


@torch.no_grad()
def target_forward(
    target: Target, input_ids: torch.Tensor, layer_ids: Sequence[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [N, T, k*H] as `target_features`, final hidden states [N, T, H] after the final norm).

    The final hidden states through the frozen lm_head are the target's own next-token logits: the
    teacher of distillation, computed from the same single pass.
    """
    outputs = target.model.base_model(input_ids=input_ids, output_hidden_states=True, use_cache=False)
    hidden = outputs.hidden_states
    return torch.cat([hidden[layer + 1] for layer in layer_ids], dim=-1), outputs.last_hidden_state


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's rule (evenly spaced from layer 1 to N-3; the middle layer for a 1-layer draft), deduplicated.

    The last layer is excluded: transformers returns it after the final norm (DeepSpec refuses it too).
    """
    from dflash.exporters.draft_config import build_target_layer_ids

    last_allowed = max(0, num_target_layers - 2)
    ids = build_target_layer_ids(num_target_layers, max(1, num_draft_layers))
    return sorted({min(max(0, i), last_allowed) for i in ids})


def check_target_layer_ids(layer_ids: Sequence[int], num_target_layers: int) -> list[int]:
    """Validate user-given ids: distinct, non-negative and below the target's last layer."""
    ids = list(layer_ids)
    if not ids or len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise InputError(
            f"target layer ids {ids} must be distinct non-negative layer indices",
            hint="e.g. --target-layer-ids 1,15,27",
        )
    if max(ids) >= num_target_layers - 1:
        raise InputError(
            f"target layer {max(ids)} is not usable: the target has layers 0..{num_target_layers - 1} and its last "
            "layer's hidden state is taken after the final norm",
            hint=f"use layers between 0 and {num_target_layers - 2}",
        )
    return ids


def choose_mask_token_id(tokenizer: Any, vocab_size: int) -> tuple[int, str]:
    """The id of the block's mask rows and why it was chosen: (id, reason).

    The mask token only needs a fixed embedding that the draft learns to read as "unknown"; its
    embedding comes from the frozen target and nothing is added to the vocabulary. In order:
    1. the tokenizer's own mask token (`mask_token`, or a token named like one);
    2. an embedding row past the tokenizer's vocabulary (padded vocabularies): never a real token;
    3. a special token the chat never produces (not bos/eos/pad/unk, absent from a rendered chat);
    4. the pad token when it differs from eos; else eos (a real target only at a response's end).
    """
    mask_id = getattr(tokenizer, "mask_token_id", None)
    if isinstance(mask_id, int) and 0 <= mask_id < vocab_size:
        return mask_id, "the tokenizer's mask token"
    vocab = tokenizer.get_vocab()
    for name in MASK_TOKEN_NAMES:
        if name in vocab and vocab[name] < vocab_size:
            return vocab[name], f"the tokenizer's {name} token"
    if len(tokenizer) < vocab_size:
        return len(tokenizer), "an embedding row past the tokenizer's vocabulary (never produced)"

    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    used = set(_chat_token_ids(tokenizer))
    specials = sorted(
        token_id
        for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(token, "special", False) and token_id < vocab_size
    )
    for token_id in specials:
        if token_id not in reserved and token_id not in used:
            return token_id, f"the unused special token {tokenizer.convert_ids_to_tokens(token_id)!r}"
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    if pad is not None and pad != eos:
        return pad, "the pad token"
    if eos is None:
        raise ModelFormatError(
            "the target's tokenizer has no mask, special, pad or eos token to use as the mask token",
            hint="add a special token to the tokenizer or pass --mask-token-id",
        )
    return eos, "the eos token (no unused special token exists)"


def _chat_token_ids(tokenizer: Any) -> list[int]:
    """Ids a rendered two-turn chat uses: its special tokens are not free for the mask."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that needs other roles: fall back to no exclusions
        return []
    return tokenizer(text, add_special_tokens=False)["input_ids"]
