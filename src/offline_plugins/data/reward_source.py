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
from pathlib import Path
from typing import Any, Callable, Sequence

from offline_plugins.errors import UserError

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
    import torch

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
    import torch

    from offline_plugins.modules.causal_lm import CausalLMReward
    from offline_plugins.modules.tiny_lm import load_causal_lm

    folder = _folder(path)
    meta = json.loads((folder / REWARD_MODEL_FILE).read_text())
    backbone, tokenizer = load_causal_lm(folder, seed=0)
    reward = CausalLMReward(backbone, heads=int(meta.get("heads", 1)), aggregate=meta.get("aggregate", "mean"),
                            uncertainty_coef=float(meta.get("uncertainty_coef", 1.0)))
    reward.head.load_state_dict(torch.load(folder / "reward_head.pt", map_location="cpu"))
    reward.eval()
    for p in reward.parameters():
        p.requires_grad_(False)
    return reward, tokenizer


def check_reward_tokenizer(path: Any, policy_tokenizer: Any) -> None:
    """Refuse a reward-model folder whose tokenizer's vocabulary differs from the policy's."""
    from transformers import AutoTokenizer

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
    import torch

    from offline_plugins.tokens import pad_token_id, prompt_token_ids

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
