"""Network-free language-model defaults: a character tokenizer built in code and a tiny causal LM.

``load_causal_lm("tiny")`` builds both from nothing; ``"small"`` and ``"small-pad-eos"`` are the
hub-shaped built-ins of :mod:`offline_plugins.modules.small_lm` (a byte-level BPE tokenizer with a
chat template and a Qwen2 model), written once into the cache and loaded from there; any other
name is a local directory or a Hugging Face hub id, loaded through the code path the small ones
take (``AutoModelForCausalLM`` / ``AutoTokenizer``) where there is a network.

>>> tok = char_tokenizer()
>>> tok.decode(tok("12+34=")["input_ids"])
'12+34='
>>> model = tiny_causal_lm(tok, seed=0)
>>> 300_000 < sum(p.numel() for p in model.parameters()) < 1_000_000
True
"""

from __future__ import annotations

import hashlib
import logging
import string
from pathlib import Path
from typing import Any, Optional, Union

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from offline_plugins.errors import UserError
from offline_plugins.modules.small_lm import SMALL_MODEL_VERSION, small_model_folder

__all__ = [
    "BUILTIN_MODELS",
    "is_builtin_model",
    "from_scratch_lr",
    "CHARACTERS",
    "TINY_MODEL_VERSION",
    "ModelLoadError",
    "char_tokenizer",
    "tiny_causal_lm",
    "load_causal_lm",
    "ensure_pad_token",
    "model_fingerprint",
    "model_cache_tag",
]

log = logging.getLogger(__name__)

#: printable ASCII: digits, letters, punctuation and the space (no tabs or newlines)
CHARACTERS: str = string.printable[:95]
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
#: changes whenever ``tiny_causal_lm``'s architecture does: a cache of models made from "tiny" keys on it
TINY_MODEL_VERSION = "gpt2-2x128"
#: the names ``load_causal_lm`` builds without a folder or a network
BUILTIN_MODELS = ("tiny", "small", "small-pad-eos")


#: a built-in model's learning rate from its random init, relative to tiny's (the algorithms' from-scratch
#: defaults are tiny's): SFT of ``small`` on the arithmetic task, 1000 steps of 64 rows, reached 91.5 %
#: held-out exact match at 1e-3 and 12.0 % after 2000 steps at tiny's 3e-3 (its loss spiked, 0.2 -> 1.6)
FROM_SCRATCH_LR_SCALE = {"tiny": 1.0, "small": 1 / 3, "small-pad-eos": 1 / 3}


def from_scratch_lr(lr: float, model: Any) -> float:
    """``lr``, a default for ``tiny`` from its random init, scaled for the built-in ``model``.

    >>> from_scratch_lr(3e-3, "tiny"), round(from_scratch_lr(3e-3, "small"), 6), from_scratch_lr(3e-3, "/my/model")
    (0.003, 0.001, 0.003)
    """
    return float(lr) * FROM_SCRATCH_LR_SCALE.get(str(model), 1.0)


def is_builtin_model(model: Any) -> bool:
    """Whether ``model`` names a built-in model (made here from its random init; the built-in tasks then
    train their SFT reference from it).

    >>> is_builtin_model("tiny"), is_builtin_model("small-pad-eos"), is_builtin_model("/models/small")
    (True, True, False)
    """
    return str(model) in BUILTIN_MODELS


def model_cache_tag(model: Any) -> str:
    """The part of a cache name that stands for ``model``: a folder's name, or ``tiny-<version>``.

    >>> model_cache_tag("tiny") == f"tiny-{TINY_MODEL_VERSION}"
    True
    >>> model_cache_tag("small").startswith("small-qwen2-")
    True
    >>> model_cache_tag("/models/my-sft")
    'my-sft'
    """
    if str(model) == "tiny":
        return f"tiny-{TINY_MODEL_VERSION}"
    if is_builtin_model(model):
        return f"{model}-{SMALL_MODEL_VERSION}"
    return Path(str(model)).name


class ModelLoadError(UserError, ValueError):
    """A model or tokenizer that cannot be loaded or does not fit the data."""


def char_tokenizer(characters: str = CHARACTERS):
    """A ``PreTrainedTokenizerFast`` with one token per character plus pad/bos/eos/unk.

    It round-trips through ``save_pretrained`` / ``AutoTokenizer.from_pretrained``.
    Characters outside ``characters`` become ``<unk>``.
    """
    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + list(dict.fromkeys(characters)))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="right",
    )


def tiny_causal_lm(
    tokenizer: Any,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_positions: int = 128,
    dropout: float = 0.0,
    seed: Optional[int] = None,
):
    """A 2-layer, 128-wide GPT-2 causal LM of ~0.4M parameters built from a config (no download).

    Why this shape (issue #17: DPO from the random init on a user's string task, 300
    steps of 16 pairs, held-out preference accuracy; ``scripts/preference_diagnosis.py``):
    at 64 wide DPO memorised the training pairs (training accuracy 0.72-0.81) and stayed
    at 0.44-0.53 held out, as the earlier RoPE Llama or as GPT-2; at 128 wide the Llama
    stayed at 0.57-0.61 (4 variants: heads, rope theta, clipping) where this GPT-2, with
    learned absolute positions, reaches 0.80 (0.86-0.88 through the CLI). Dropout is off:
    it changed nothing here (0.79 without, 0.80 with), and without it the policy's
    training log-probs equal the reference's at step 0, so the implicit reward starts at
    exactly 0.
    """
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=max_positions,
        n_embd=hidden_size,
        n_layer=num_layers,
        n_head=num_heads,
        n_inner=intermediate_size,
        # torch's fused GELU: GPT-2's default "gelu_new" is a Python tanh formula, a third of a step
        activation_function="gelu",
        resid_pdrop=dropout,
        embd_pdrop=dropout,
        attn_pdrop=dropout,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    # marks a model made here, so a save_pretrained copy reloads as the same class
    config.offline_plugins_tiny = TINY_MODEL_VERSION
    cls = _tiny_gpt2_class()
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls(config)
    else:
        model = cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


_TINY_CLASS = None


def _tiny_gpt2_class():
    """``GPT2LMHeadModel`` whose ``forward`` takes ``attention_mask`` second, as Llama's does.

    GPT-2's second positional argument is its cache; TorchRL's ``TransformersWrapper``
    calls ``model(tokens, attention_mask)`` positionally. Same weights, same outputs,
    same ``save_pretrained`` files (built on first use: transformers is a slow import).
    """
    global _TINY_CLASS
    if _TINY_CLASS is None:
        class TinyGPT2LMHeadModel(GPT2LMHeadModel):
            # ``position_ids`` is named: transformers' generate derives it from the attention mask
            # (positions counted from each row's first real token) only for a forward that names
            # it; without it a left-padded prompt is read as many positions late as it is padded
            def forward(self, input_ids=None, attention_mask=None, *args, position_ids=None, **kwargs):
                if args:
                    raise TypeError("pass arguments after attention_mask by keyword")
                return super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                       **kwargs)

        _TINY_CLASS = TinyGPT2LMHeadModel
    return _TINY_CLASS


def ensure_pad_token(tokenizer: Any) -> Optional[str]:
    """Give a tokenizer without a pad token one (its eos, else a new ``<pad>``); returns a note or None.

    Padding positions are masked out of every loss, so reusing eos is safe; the
    note says what was done so the caller can report it.
    """
    if tokenizer.pad_token_id is not None:
        return None
    if tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
        note = f"tokenizer had no pad token; using its eos token {tokenizer.eos_token!r} for padding"
    else:
        tokenizer.add_special_tokens({"pad_token": "<pad>"})
        note = "tokenizer had no pad or eos token; added a new '<pad>' token (resize the model's embeddings)"
    tokenizer.padding_side = "right"
    log.warning(note)
    return note


def load_causal_lm(
    name_or_path: Union[str, Path] = "tiny", *, seed: Optional[int] = 0, dtype: torch.dtype = torch.float32
):
    """``(model, tokenizer)``: ``"tiny"`` builds them in code; ``"small"`` / ``"small-pad-eos"`` are
    written once into the cache for ``seed`` (``None``: seed 0) and loaded from there like any folder;
    otherwise a local dir or hub id.

    A tokenizer without a pad token gets one (see :func:`ensure_pad_token`), and the
    model's embeddings grow if a token had to be added.
    """
    if str(name_or_path) == "tiny":
        tokenizer = char_tokenizer()
        return tiny_causal_lm(tokenizer, seed=seed).to(dtype), tokenizer
    if is_builtin_model(name_or_path):
        name_or_path = small_model_folder(str(name_or_path), seed=0 if seed is None else seed)

    _check_model_folder(name_or_path)
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load reports are multi-line; a failure is said in one line below
    hf_logging.disable_progress_bar()  # a bar per load of a few-MB model is noise in a run's output
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(name_or_path))
        model = AutoModelForCausalLM.from_pretrained(str(name_or_path), dtype=dtype)
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, RuntimeError, safetensors'
        first = next((line.strip() for line in str(exc).splitlines() if line.strip()), "")[:200]
        if "ignore_mismatched_sizes" in first:
            first = "a weight's shape differs from what config.json describes (e.g. vocab_size or n_embd)"
        raise ModelLoadError(
            f"cannot load model {str(name_or_path)!r}: {exc.__class__.__name__}: {first}; "
            f"pass 'tiny' or 'small' for a built-in model, a directory written by save_pretrained (the model's and the "
            f"tokenizer's, from a transformers causal LM), or a hub id (needs a network)"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    rows = model.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > rows:
        raise ModelLoadError(
            f"model {str(name_or_path)!r}: its tokenizer has {len(tokenizer)} tokens but the model's embedding has "
            f"{rows} rows, so some token ids have no embedding; save the tokenizer the model was trained with, or "
            "resize the embeddings (model.resize_token_embeddings(len(tokenizer))) before save_pretrained")
    if getattr(model.config, "offline_plugins_tiny", None) and type(model).__name__ == "GPT2LMHeadModel":
        model.__class__ = _tiny_gpt2_class()  # a saved tiny model: the same positional signature again
    n_before = len(tokenizer)
    ensure_pad_token(tokenizer)
    if len(tokenizer) > n_before:
        model.resize_token_embeddings(len(tokenizer))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model",
                    "spiece.model")


def _check_model_folder(name_or_path: Union[str, Path]) -> None:
    """A local ``--model`` path must be a folder holding a ``config.json`` and a tokenizer's files
    (transformers would otherwise fall back to a default tokenizer, or read a hub id)."""
    p = Path(str(name_or_path))
    if not p.exists():
        return  # a hub id (or a mistyped path: the load error names it)
    if not p.is_dir():
        raise ModelLoadError(f"model {str(p)!r} is a file; give the folder save_pretrained wrote (config.json, "
                             "the weights and the tokenizer's files), or 'tiny'")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"model folder {str(p)!r} has no config.json; give a folder written by "
                             "model.save_pretrained(folder) and tokenizer.save_pretrained(folder), or 'tiny'")
    if not any((p / name).is_file() for name in _TOKENIZER_FILES):
        raise ModelLoadError(f"model folder {str(p)!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES[:3])}, "
                             "...); save the model's tokenizer into it with tokenizer.save_pretrained(folder)")


def model_fingerprint(model: torch.nn.Module, tokenizer: Any = None) -> str:
    """A short hash of a model's weights (and tokenizer vocabulary): the reference-cache key."""
    h = hashlib.sha256()
    config = getattr(model, "config", None)
    if config is not None:
        h.update(str(getattr(config, "vocab_size", "")).encode())
        h.update(type(model).__name__.encode())
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            h.update(name.encode())
            h.update(str(tuple(p.shape)).encode())
            h.update(p.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        h.update(repr(sorted(vocab.items())).encode())
    return h.hexdigest()[:16]
