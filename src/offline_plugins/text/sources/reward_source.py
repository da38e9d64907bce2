"""A trained reward model as the reward of online RL (``--reward DIR``): save, load, score.

A reward-model run (``offline-plugins train reward-model``) exports ``OUT/reward_model``
(:func:`save_reward_model`): the backbone as a ``save_pretrained`` folder with its tokenizer,
the score head's weights (``reward_head.pt``) and ``reward_model.json`` (heads, aggregate).
:func:`reward_model_function` loads it and returns a reward function with the signature of
``--reward module:function`` (``fn(prompts, responses, **columns) -> list[float]``) that scores
each prompt + response as one token sequence: the prompt's ids (:func:`~offline_plugins.tokens.prompt_token_ids`,
bos first) and the response's ids, then eos.

Tokenizers: the folder's tokenizer must equal the policy's (same vocabulary); a different one is
refused (:func:`check_reward_tokenizer`) rather than re-tokenised, because a silent text round
trip can change what the reward model reads and the refusal is easy to fix (train the reward
model on the policy's ``--model``).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from transformers import AutoTokenizer

from offline_plugins.errors import UserError
from offline_plugins.modules.causal_lm import ENSEMBLE_AGGREGATES, CausalLMReward
from offline_plugins.modules.tiny_lm import load_causal_lm
from offline_plugins.tokens import pad_token_id, prompt_token_ids

__all__ = ["RewardModelError", "REWARD_MODEL_FILE", "is_reward_model_dir", "save_reward_model", "load_reward_model",
           "check_reward_tokenizer", "reward_model_function"]

REWARD_MODEL_FILE = "reward_model.json"


class RewardModelError(UserError, ValueError):
    """A reward-model folder that cannot be used as a reward."""


def is_reward_model_dir(path: Any) -> bool:
    p = Path(str(path))
    return p.is_dir() and ((p / REWARD_MODEL_FILE).is_file() or (p / "reward_model" / REWARD_MODEL_FILE).is_file())


def _folder(path: Any) -> Path:
    p = Path(str(path))
    if (p / REWARD_MODEL_FILE).is_file():
        return p
    if (p / "reward_model" / REWARD_MODEL_FILE).is_file():  # a reward-model run's OUT dir
        return p / "reward_model"
    raise RewardModelError(f"--reward {str(path)!r} is a folder without {REWARD_MODEL_FILE}; give a reward-model run's "
                           "OUT dir or its OUT/reward_model folder (offline-plugins train reward-model ...), or a "
                           "reward function module:function")


def save_reward_model(reward: Any, tokenizer: Any, out: Path) -> Path:
    """Write a :class:`~offline_plugins.modules.causal_lm.CausalLMReward` to the folder ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    reward.model.save_pretrained(out)
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(out)
    torch.save({k: v.detach().cpu() for k, v in reward.head.state_dict().items()}, out / "reward_head.pt")
    (out / REWARD_MODEL_FILE).write_text(json.dumps({"format": 1, "heads": reward.num_heads,
                                                     "aggregate": reward.aggregate,
                                                     "uncertainty_coef": reward.uncertainty_coef}, indent=1))
    return out


def load_reward_model(path: Any):
    """``(CausalLMReward, tokenizer)`` from a folder :func:`save_reward_model` wrote (eval mode, frozen)."""
    folder = _folder(path)
    meta_file = folder / REWARD_MODEL_FILE
    try:
        meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise RewardModelError(f"{meta_file} is not a JSON object ({type(exc).__name__}); the folder is damaged: "
                               "export the reward model again (offline-plugins train reward-model)") from None
    heads, aggregate = meta.get("heads", 1) if isinstance(meta, dict) else None, None
    if isinstance(meta, dict):
        aggregate = meta.get("aggregate", "mean")
    if (isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or aggregate not in ENSEMBLE_AGGREGATES
            or not isinstance(meta.get("uncertainty_coef", 1.0), (int, float))):
        raise RewardModelError(f"{meta_file} must hold heads (a whole number >= 1), aggregate (one of "
                               f"{', '.join(ENSEMBLE_AGGREGATES)}) and uncertainty_coef (a number), got "
                               f"{str(meta)[:120]}; export the reward model again")
    backbone, tokenizer = load_causal_lm(folder, seed=0)
    reward = CausalLMReward(backbone, heads=heads, aggregate=aggregate,
                            uncertainty_coef=float(meta.get("uncertainty_coef", 1.0)))
    reward.head.load_state_dict(_read_head(folder, reward.head))
    reward.eval()
    for p in reward.parameters():
        p.requires_grad_(False)
    return reward, tokenizer


def _read_head(folder: Path, head: Any) -> dict:
    """``reward_head.pt`` opened with ``weights_only=True`` (tensors only, never code), checked
    against the head the metadata describes; a missing, unreadable or mismatched file is a
    :class:`RewardModelError` naming it."""
    path = folder / "reward_head.pt"
    if not path.is_file():
        raise RewardModelError(f"reward model {str(folder)!r} has no reward_head.pt; the folder is incomplete: "
                               "export it again with offline-plugins train reward-model")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError) as exc:
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        raise RewardModelError(f"{path} could not be read as tensors ({first}); nothing in it ran. It may be "
                               "truncated or not written by offline-plugins: export the reward model again") from None
    expected = head.state_dict()
    if not isinstance(state, dict) or set(state) != set(expected):
        got = sorted(state)[:4] if isinstance(state, dict) else type(state).__name__
        raise RewardModelError(f"{path} holds {got}, expected the score head's tensors {sorted(expected)}; "
                               f"is {REWARD_MODEL_FILE} (heads) from the same export?")
    for name, want in expected.items():
        got = state[name]
        if not torch.is_tensor(got) or got.shape != want.shape:
            shape = tuple(got.shape) if torch.is_tensor(got) else type(got).__name__
            raise RewardModelError(f"{path}: {name} has shape {shape}, the backbone and {REWARD_MODEL_FILE} "
                                   f"expect {tuple(want.shape)}; the head belongs to another model: export the "
                                   "reward model again")
    return state


def check_reward_tokenizer(path: Any, policy_tokenizer: Any) -> None:
    """Refuse a reward-model folder whose tokenizer's vocabulary differs from the policy's."""
    rm_tok = AutoTokenizer.from_pretrained(str(_folder(path)))
    a, b = rm_tok.get_vocab(), policy_tokenizer.get_vocab()
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()))[:3]
        raise RewardModelError(
            f"--reward {str(path)!r}: the reward model's tokenizer ({len(a)} tokens) differs from the policy's "
            f"({len(b)} tokens; e.g. {differ}); the reward model scores token ids, so train it on the policy's "
            "model (offline-plugins train reward-model --model <the policy's --model>)")


def reward_model_function(path: Any) -> Callable[..., Sequence[float]]:
    """A ``--reward`` function scoring prompt + response with the reward model in ``path``."""
    reward, tokenizer = load_reward_model(path)
    pad, eos = pad_token_id(tokenizer), tokenizer.eos_token_id

    @torch.no_grad()
    def score(prompts, responses, **_):
        seqs = [prompt_token_ids(tokenizer, p) + tokenizer(r, add_special_tokens=False)["input_ids"]
                + ([eos] if eos is not None else []) for p, r in zip(prompts, responses)]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        attn = torch.zeros(len(seqs), width, dtype=torch.bool)
        for i, s in enumerate(seqs):
            ids[i, :len(s)] = torch.tensor(s)
            attn[i, :len(s)] = True
        return reward.rewards(ids, attn).tolist()

    score.__name__ = f"reward_model[{path}]"
    return score
