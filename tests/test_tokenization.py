"""The engine's tokenizer read straight from tokenizer.json (core/tokenization.JsonTokenizer) against
transformers' AutoTokenizer on the same folders: same ids, same text, same rendered chat."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from dflash.core.tokenization import JsonTokenizer, load_tokenizer, tokenize_prompt
from dflash.exporters.tiny import build_tokenizer

TEXTS = [
    "Hello, world! How are you today?",
    "def add(a, b):\n    return a + b\n",
    "  two leading spaces,\ta tab, a trailing space ",
    "naïve café, 中文, 😀",
    "<|im_start|>user\nspecial tokens inside<|im_end|>",
    "",
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 + 3, naïvely?"},
    ],
]
# Features of transformers' template environment: trim_blocks/lstrip_blocks, loop controls, its
# tojson (no HTML escaping, non-ASCII kept), raise_exception, and the special tokens as variables.
FEATURES_TEMPLATE = """{{ bos_token if bos_token is defined else '' }}
{% for message in messages %}
    {% if message['role'] == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}
    {% if loop.index > 3 %}{% break %}{% endif %}
    <{{ message['role'] }}>{{ message | tojson }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<assistant>{% endif %}"""


def _save(folder, tokenizer, **config_changes):
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(config_changes)
    config_path.write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _save(tmp_path_factory.mktemp("tok"), build_tokenizer())


def _assert_same(folder, chats=CHATS):
    ours, theirs = JsonTokenizer.load(folder), AutoTokenizer.from_pretrained(folder)
    assert ours is not None
    for text in TEXTS:
        for special in (True, False):
            assert ours(text, add_special_tokens=special)["input_ids"] == theirs(text, add_special_tokens=special)["input_ids"]
        ids = theirs(text)["input_ids"]
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    for chat in chats:
        for generation_prompt in (True, False):
            kwargs = dict(add_generation_prompt=generation_prompt, tokenize=False)
            assert ours.apply_chat_template(chat, **kwargs) == theirs.apply_chat_template(chat, **kwargs)
        assert tokenize_prompt(ours, chat, chat=True) == tokenize_prompt(theirs, chat, chat=True)
    assert ours.eos_token_id == theirs.eos_token_id is not None
    assert ours.convert_tokens_to_ids(["<|im_end|>", "<|mask|>"]) == theirs.convert_tokens_to_ids(["<|im_end|>", "<|mask|>"])
    assert ours.convert_ids_to_tokens([0, 5, 300]) == theirs.convert_ids_to_tokens([0, 5, 300])


def test_the_tiny_tokenizer_equals_transformers(tiny_dir):
    _assert_same(tiny_dir)


def test_transformers_template_environment_is_reproduced(tmp_path):
    folder = _save(tmp_path, build_tokenizer(), chat_template=FEATURES_TEMPLATE, bos_token="<|im_start|>")
    (folder / "chat_template.jinja").unlink(missing_ok=True)  # the template from tokenizer_config.json
    long_chat = [{"role": "user", "content": 'naïve quotes " and <b>tags</b>'}] + CHATS[1]
    _assert_same(folder, CHATS + [long_chat])
    rendered = JsonTokenizer.load(folder).apply_chat_template(long_chat, tokenize=False)
    assert '"naïve quotes \\" and <b>tags</b>"' in rendered  # JSON, but no HTML or \\u escapes
    assert rendered.count("<|im_end|>") == 3  # the loop broke after three messages
    with pytest.raises(Exception, match="no tools here"):
        JsonTokenizer.load(folder).apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_named_templates_use_the_default_one(tmp_path):
    named = [{"name": "default", "template": FEATURES_TEMPLATE}, {"name": "tool_use", "template": "TOOLS"}]
    folder = _save(tmp_path, build_tokenizer(), chat_template=named)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    assert JsonTokenizer.load(folder).chat_template == FEATURES_TEMPLATE


@pytest.mark.parametrize(
    "change, why",
    [
        ({"add_bos_token": True}, "transformers adds BOS from the config"),
        ({"clean_up_tokenization_spaces": True}, "transformers cleans decoded spaces"),
        ({"chat_template": "{% generation %}x{% endgeneration %}"}, "transformers' own template tag"),
    ],
)
def test_folders_transformers_would_change_go_through_transformers(tmp_path, change, why):
    folder = _save(tmp_path, build_tokenizer(), **change)
    if "chat_template" in change:
        (folder / "chat_template.jinja").unlink(missing_ok=True)
    assert JsonTokenizer.load(folder) is None, why
    assert not isinstance(load_tokenizer(folder), JsonTokenizer)
    assert load_tokenizer(folder)("Hello")["input_ids"]


def test_a_folder_without_tokenizer_json_goes_through_transformers(tmp_path, tiny_dir):
    assert JsonTokenizer.load(tmp_path) is None
    assert isinstance(load_tokenizer(tiny_dir), JsonTokenizer)


def test_the_engine_tokenizes_without_importing_transformers(tiny_dir):
    """transformers' import (torch with it) was most of a later `dflash generate` run's start."""
    code = (
        "import sys\n"
        "from dflash.core.engine import LLMEngine\n"
        "from dflash.core.tokenization import load_tokenizer, tokenize_prompt\n"
        f"tok = load_tokenizer({str(tiny_dir)!r})\n"
        "assert tokenize_prompt(tok, 'Hi', chat=True)[1]\n"
        "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
