"""The built-in ``small`` model: a hub-shaped model made in code, loaded the way a hub model is.

``tiny`` (:mod:`offline_plugins.modules.tiny_lm`) is a character tokenizer and a GPT-2 built in
memory. ``small`` takes the path a Qwen2 or Llama checkpoint takes:

* a **byte-level BPE tokenizer** trained here with Hugging Face ``tokenizers`` on the package's own
  task corpora (:func:`task_corpus`): every byte is a token, so any text encodes (newlines, tabs,
  non-ASCII); digits are split one per token before the merges (as Qwen2 and Llama 3 do), so
  ``123`` is always ``1 2 3``; the merges learn the tasks' words (``<tool name="calculator">``...);
* a **ChatML chat template** with ``system``, ``user``, ``assistant`` and ``tool`` roles whose
  assistant turns are marked for ``return_assistant_tokens_mask`` (``{% generation %}``); eos is
  ``<|im_end|>``, the token that closes a turn, there is no bos (as Qwen2);
* a **Qwen2 model from a config** (:data:`SMALL_CONFIG`): rotary positions, grouped-query attention
  (6 query heads of 32, 2 key/value heads), RMSNorm, SwiGLU, tied input/output embeddings;
* written once into the cache (``$OFFLINE_PLUGINS_CACHE/models/<tag>``) by ``save_pretrained`` and
  read back by ``AutoTokenizer`` / ``AutoModelForCausalLM``, the code path of a downloaded model.

Two tokenizer variants, the two a user meets:

* ``small``: pad ``<|endoftext|>`` distinct from eos ``<|im_end|>`` (as Qwen2-Instruct);
* ``small-pad-eos``: no pad token saved; the loader pads with eos, as a user of a base model whose
  tokenizer has none does. Padding is then the eos id, so only the masks tell a response's scored
  eos from the padding after it.

>>> tok = small_tokenizer()
>>> [tok.decode([i]) for i in tok("12+345=")["input_ids"]]
['1', '2', '+', '3', '4', '5', '=']
>>> tok.decode(tok("a\\n\\tb")["input_ids"])
'a\\n\\tb'
>>> tok.eos_token, tok.pad_token, tok.bos_token
('<|im_end|>', '<|endoftext|>', None)
>>> tok.apply_chat_template([{"role": "user", "content": "2+2="}], tokenize=False, add_generation_prompt=True)
'<|im_start|>user\\n2+2=<|im_end|>\\n<|im_start|>assistant\\n'
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from offline_plugins.config import cache_root
from offline_plugins.modules.task_text import FRIENDS, ITEMS, OPENINGS, OPERATIONS, PEOPLE, QUESTIONS

__all__ = [
    "SMALL_MODEL_VERSION",
    "SMALL_MODELS",
    "SMALL_CONFIG",
    "CHAT_TEMPLATE",
    "task_corpus",
    "small_tokenizer",
    "small_causal_lm",
    "small_model_folder",
]

#: the built-in names this module makes: name -> whether the tokenizer keeps a pad token of its own
SMALL_MODELS: dict[str, bool] = {"small": True, "small-pad-eos": False}

#: changes whenever the corpus, the tokenizer's training or the architecture does: the cache folder keys on it
SMALL_MODEL_VERSION = "qwen2-4x192-bpe1k-v3"

#: the Qwen2 architecture: 1.76 M parameters (197 k of them the tied embedding of 1,024 tokens)
SMALL_CONFIG: dict[str, Any] = {
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "attention_dropout": 0.0,
}

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: ChatML, as Qwen2's: each turn ``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n``; the assistant's content and its
#: ``<|im_end|>`` are the generation (what ``return_assistant_tokens_mask`` marks and what a policy writes)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{- raise_exception('unknown role ' + message['role'] + '; use system, user, assistant or tool') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}{{- message['content'] + '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def task_corpus(seed: int = 0) -> list[str]:
    """The texts the tokenizer is trained on, in the built-in tasks' formats: arithmetic prompts and
    answers, calculator and Python tool episodes, step-by-step solutions one step a line, word
    problems in words (from :mod:`offline_plugins.modules.task_text`, the sentences the
    word-problem tasks use) with their solutions, chat turns and a little Python (fixed by ``seed``). Made here, below the environments that define the tasks
    (this layer does not import them); ``tests/test_small_model.py`` checks that every built-in task's
    demonstrations tokenise compactly with the result.

    >>> corpus = task_corpus()
    >>> len(corpus) > 1000, any("<tool" in t for t in corpus), any("\\n" in t for t in corpus)
    (True, True, True)
    """
    rng = random.Random(seed)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    texts: list[str] = []
    for digits in (1, 2, 3, 4):
        for op, f in ops.items():
            for _ in range(300):
                a, b = rng.randint(0, 10**digits - 1), rng.randint(0, 10**digits - 1)
                texts.append(f"{a}{op}{b}={f(a, b)}")
    for _ in range(400):  # tool-arithmetic and tool-python episodes
        a, b = rng.randint(100, 999), rng.randint(100, 999)
        texts.append(f'<tool name="calculator">...</tool> {a}*{b}=<tool name="calculator">{a}*{b}</tool>'
                     f"<result>{a * b}</result>{a * b}")
        rev = str(a * b)[::-1]
        texts.append(f'<tool name="python">...</tool> rev({a}*{b})=<tool name="python">print(str({a}*{b})[::-1])'
                     f"</tool><result>{rev}</result>{rev}")
    for _ in range(400):  # step chains, one step a line
        value = rng.randint(1, 9)
        chain, lines = str(value), []
        for _ in range(rng.randint(2, 3)):
            op, b = rng.choice("+-*"), rng.randint(1, 9)
            chain += f"{op}{b}"
            lines.append(f"{value}{op}{b}={ops[op](value, b)}")
            value = ops[op](value, b)
        texts.append(chain + "=\n" + "\n".join(lines))
    texts += _word_problem_texts(rng, 1500)
    words = ("the answer is", "compute", "what is", "the sum of", "the product of", "write the digits backwards",
             "think step by step", "call the calculator", "use the tool", "You are a helpful assistant.",
             "result", "correct", "wrong", "number", "digits", "print", "def", "return", "for", "in", "range")
    for _ in range(600):
        texts.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))).capitalize() + ".")
    for role in ("system", "user", "assistant", "tool"):
        texts += [f"{role}\n" + rng.choice(words) for _ in range(50)]
    texts += [f"def f(x):\n    return x * {i}\n\nprint(f({i + 1}))\n" for i in range(100)]
    texts += [f"for i in range({i}):\n\tprint(str(i)[::-1])\n" for i in range(100)]
    return texts


def _word_problem_texts(rng: random.Random, n: int) -> list[str]:
    """Word problems in the built-in tasks' sentences with their solutions, one step a line then
    ``#### N``, or as calculator calls or a Python program (the numbers are random: only the
    words and the layout matter to the merges)."""
    symbols = {"add": "+", "sub": "-", "mul": "*", "div": "/"}
    texts = []
    for i in range(n):
        name, subject, obj = rng.choice(PEOPLE)
        words = {"name": name, "P": subject.capitalize(), "p": subject, "o": obj, "item": rng.choice(ITEMS)}
        value = rng.randint(5, 99)
        story, lines, program, calls = [rng.choice(OPENINGS).format(b=value, **words)], [], [f"x={value}"], []
        for _ in range(rng.randint(2, 8)):
            op = rng.choice(sorted(OPERATIONS))
            b = rng.randint(2, 9) if op in ("mul", "div") else rng.randint(2, 60)
            sentence = rng.choice(OPERATIONS[op]).format(b=b, friend=rng.choice(FRIENDS), **words)
            story.append(sentence[0].upper() + sentence[1:])
            result = rng.randint(0, 999)
            lines.append(f"{value}{symbols[op]}{b}={result}")
            calls.append(f'<tool name="calculator">{value}{symbols[op]}{b}</tool><result>{result}</result>')
            program.append(f"x=x{'//' if op == 'div' else symbols[op]}{b}")
            value = result
        story.append(rng.choice(QUESTIONS).format(**words))
        answer = f"#### {value}"
        form = i % 3
        if form == 0:
            texts.append(" ".join(story) + "\n" + "\n".join(lines) + "\n" + answer)
        elif form == 1:
            texts.append('<tool name="calculator">...</tool> ' + " ".join(story) + "".join(calls) + answer)
        else:
            texts.append('<tool name="python">...</tool> ' + " ".join(story) + '<tool name="python">'
                         + "\n".join([*program, "print(x)"]) + f"</tool><result>{value}</result>" + answer)
    return texts


def small_tokenizer(*, pad: bool = True, seed: int = 0):
    """A ``PreTrainedTokenizerFast``: byte-level BPE of :data:`VOCAB_SIZE` tokens trained on
    :func:`task_corpus`, digits one per token, :data:`CHAT_TEMPLATE`; ``pad=False`` saves no pad token."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(task_corpus(seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>" if pad else None,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def small_causal_lm(tokenizer: Any, *, seed: Optional[int] = 0, **overrides: Any):
    """A ``Qwen2ForCausalLM`` of :data:`SMALL_CONFIG` (``overrides`` change fields) sized to ``tokenizer``."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    # a tokenizer without pad makes a config without one, as a base model's: its eos row is then no padding_idx
    config = Qwen2Config(vocab_size=len(tokenizer), bos_token_id=None, eos_token_id=eos, pad_token_id=pad,
                         **{**SMALL_CONFIG, **overrides})
    config.offline_plugins_small = SMALL_MODEL_VERSION
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(config)
    else:
        model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos if pad is None else pad
    model.generation_config.bos_token_id = None
    return model


def _models_root() -> Path:
    return cache_root() / "models"


def small_model_folder(name: str = "small", *, seed: int = 0, root: Optional[Path] = None) -> Path:
    """The ``save_pretrained`` folder of a built-in ``small`` model at ``seed``, written on first use.

    The tokenizer is trained once per version and copied beside each seed's weights; ``fingerprint.json``
    records the vocabulary's hash, so a cache written by another version of ``tokenizers`` that trained
    different merges is noticed (and rebuilt) instead of being mixed with this one.
    """
    if name not in SMALL_MODELS:
        raise KeyError(f"unknown built-in model {name!r}; the small ones are {', '.join(SMALL_MODELS)}")
    root = Path(root) if root is not None else _models_root()
    folder = root / f"{name}-{SMALL_MODEL_VERSION}-s{seed}"
    if (folder / "fingerprint.json").is_file() and (folder / "config.json").is_file():
        return folder
    tokenizer = small_tokenizer(pad=SMALL_MODELS[name])
    model = small_causal_lm(tokenizer, seed=seed)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar for one shard of a few MB
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.partial-", dir=root))
    try:  # written beside its place and renamed into it: a folder is whole or absent
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "fingerprint.json").write_text(json.dumps(
            {"name": name, "version": SMALL_MODEL_VERSION, "seed": seed, "vocab_sha256": vocab_hash(tokenizer)},
            indent=1) + "\n")
        if folder.exists():  # a half-made folder of an older layout: replaced
            shutil.rmtree(folder, ignore_errors=True)
        try:
            os.rename(tmp, folder)
        except OSError:  # another process made it first: theirs is the same model
            if not (folder / "fingerprint.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if bars:
            hf_logging.enable_progress_bar()
    return folder


def vocab_hash(tokenizer: Any) -> str:
    """A short hash of a tokenizer's vocabulary (token -> id), the merges' result."""
    return hashlib.sha256(json.dumps(sorted(tokenizer.get_vocab().items())).encode()).hexdigest()[:16]
