"""Text Decision Transformer (``text-dt``): return-conditioned generation on the rollouts of GRPO.

The seeds' Decision Transformer on text (Chen et al. 2021, arXiv:2106.01345): a prompt
carries the return the response should earn, as a reward token (Quark, Lu et al. 2022,
arXiv:2205.13636), the policy samples conditioned on the target (best) return, every
sampled row is relabelled with the return it achieved and fine-tuned by NLL (the Online
Decision Transformer's hindsight relabelling, Zheng et al. 2022, arXiv:2202.05607), and at
evaluation the held-out prompts carry the best-return token. The loss is
:class:`~offline_plugins.objectives.llm.text_dt.TextDTLoss`; the rollouts are the
``text-rollouts`` kind's, sampled by its collector into the same buffer GRPO reads.

Why added special tokens ``<|return=l|>`` and not a text prefix such as ``"<R=1> "``: one
token per level, which no prompt or response can spell by accident, and which the reward
function never sees (the prefix is stripped before it is called). Why the token takes the
place of bos (position 0, the DT's ``R_hat`` before the state) rather than following it: the
tiny model has learned absolute positions, and shifting the prompt by one position breaks it
(measured on the built-in task's SFT reference, 200 held-out prompts, greedy: 88.0 % plain,
0.0 % after ``[bos, <|return=1|>]`` with the new row at the mean embedding, 0.5 % with the
new row a copy of bos's, 0.0 % after a text prefix ``"R1:"``). So for a tokenizer without a
chat template, ``build`` installs one (:data:`CHAT_TEMPLATE`) that renders a prompt starting
with a return token as it is (no bos) and any other prompt as bos + prompt. The target
return's token starts as a copy of bos's embedding, so at step 0 the policy conditioned on the
target has the reference's logits over the reference's vocabulary (the same greedy answers: the
held-out exact match "before" is the reference's; the new tokens take a little softmax mass);
the other levels' tokens start at the mean embedding row, a context distinct from the start
(with every token a copy of bos the policy never told them apart: pilot, seed 0, 1200 steps,
held-out exact match 8.0 % conditioned on return 0 and 8.5 % on return 1; with the mean row it
does not either, docs/results-history.md). A tokenizer
that has a chat template keeps it, and the token leads the user turn's text. The exported
tokenizer (``OUT/model``) holds the tokens and the template, so ``AutoTokenizer`` reloads them
and ``apply_chat_template`` conditions a prompt the way training did.

``build(config, data)`` leaves the run's :class:`~offline_plugins.text.data.rollouts.RolloutData`
as loaded and says in the round's :class:`~offline_plugins.algorithms.base.RolloutPlan` what
differs: a :class:`ConditionedPromptSource` (wrapping ``data.source``) whose sampled and
held-out prompts start with the target token, a copy of the reference with grown embeddings,
and a copy of the tokenizer with the reward tokens. The run's collector is made from them
(:meth:`~offline_plugins.text.data.rollouts.RolloutData.collector_for`), so its rows are sized for
the conditioned prompts (with the token in place of bos as wide as before, with a chat
template one wider); ``build`` refuses a prompt that no longer fits the model's context.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

from offline_plugins.algorithms.llm import policy_and_reference, policy_log_probs, resolve_lr
from offline_plugins.algorithms.online import _lr_help, _RolloutFields
from offline_plugins.config import config_field
from offline_plugins.errors import UserError
from offline_plugins.plugins.hookspecs import hookimpl
from offline_plugins.plugins.registry import AlgorithmSpec
from offline_plugins.text.sources.prompts import PromptSource

__all__ = ["TextDTConfig", "CHAT_TEMPLATE", "return_token", "conditioned_source", "build_text_dt"]

#: what ``build`` installs on a tokenizer without a chat template: the return token in place of bos
CHAT_TEMPLATE = ("{% set text = messages[0]['content'] %}{% if text.startswith('<|return=') %}{{ text }}"
                 "{% else %}{{ bos_token }}{{ text }}{% endif %}")


@dataclass
class TextDTConfig(_RolloutFields):
    pretrained_lr: ClassVar[float] = 3e-4
    lr: Optional[float] = config_field(None, _lr_help(3e-4))
    return_levels: tuple = config_field((0.0, 1.0), "increasing return levels, one reward token each; a reward "
                                                    "gets the token of the highest level it reaches")
    target_return: Optional[float] = config_field(None, "the level sampling and evaluation are conditioned on "
                                                        "(unset: the highest)")
    low_return_weight: float = config_field(1.0, "NLL weight of rows that fell short of the target (1: the "
                                                 "Decision Transformer, every row; 0: expert iteration with a token)")


def return_token(level: float) -> str:
    """The reward token of a return level.

    >>> return_token(1.0), return_token(0.25)
    ('<|return=1|>', '<|return=0.25|>')
    """
    return f"<|return={float(level):g}|>"


def _check_levels(config: TextDTConfig) -> tuple[list[float], float]:
    raw = config.return_levels
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        raw = (raw,)
    try:
        levels = [float(x) for x in raw if not isinstance(x, bool)]
        ok = len(levels) == len(raw)
    except (TypeError, ValueError):
        ok = False
    if not ok or not levels or not all(math.isfinite(x) for x in levels) \
            or any(b <= a for a, b in zip(levels, levels[1:])):
        raise UserError(f"text-dt: return_levels must be increasing finite numbers, got {config.return_levels!r}; "
                        "fix it with --set return_levels=[0,1] (the exact-match reward's two values)")
    if len({return_token(x) for x in levels}) != len(levels):
        raise UserError(f"text-dt: return_levels {levels} give the same token twice (printed with %g); "
                        "use levels that differ in their first 6 significant digits")
    target = config.target_return
    if target is None:
        target = levels[-1]
    elif isinstance(target, bool) or not isinstance(target, (int, float)) or float(target) not in levels:
        raise UserError(f"text-dt: target_return {target!r} is none of the return levels {levels}; condition on "
                        f"one of them, e.g. --set target_return={levels[-1]:g} (the best), or add it to "
                        "return_levels")
    return levels, float(target)


@dataclass
class ConditionedPromptSource(PromptSource):
    """A :class:`~offline_plugins.text.sources.prompts.PromptSource` whose prompts start with a reward token.

    ``base`` is the unconditioned source; ``sample`` and ``held_out`` give its rows with
    ``prefix`` (the target return's token) before the prompt; the reward function gets the
    prompts without any return token (``token_texts``), so a task's verifier that parses
    its prompt is unaffected.
    """

    base: Any = None
    prefix: str = ""
    token_texts: tuple = ()

    def sample(self, n: int, seed: int) -> list[dict]:
        return [{**r, "prompt": self.prefix + r["prompt"]} for r in self.base.sample(n, seed)]


def _strip(prompt: str, texts) -> str:
    for t in texts:
        if prompt.startswith(t):
            return prompt[len(t):]
    return prompt


def conditioned_source(source: Any, prefix: str, token_texts) -> Any:
    """``source`` with ``prefix`` before every sampled and held-out prompt (see :class:`ConditionedPromptSource`).

    A source that is already conditioned is re-conditioned from its base (never prefixed twice).
    """
    base = getattr(source, "base", None) or source
    texts = tuple(token_texts)
    base_fn = base.reward_fn

    def reward(prompts, responses, **columns):
        return base_fn([_strip(p, texts) for p in prompts], responses, **columns)

    return ConditionedPromptSource(
        name=base.name, held_out=[{**r, "prompt": prefix + r["prompt"]} for r in base.held_out],
        reward_fn=reward, reward_name=base.reward_name, train=base.train, sample_fn=None,
        longest_prompts=[prefix + p for p in base.longest_prompts], base=base, prefix=prefix, token_texts=texts)


def _grow_embeddings(model: Any, n_tokens: int, copies: dict) -> None:
    """Resize ``model``'s token embeddings to ``n_tokens``; new row ``i`` starts as a copy of row
    ``copies[i]`` (bos, for the target return's token), any other new row at the old rows' mean."""
    import torch

    emb = model.get_input_embeddings()
    old = emb.weight.shape[0]
    if old >= n_tokens:
        return
    model.resize_token_embeddings(n_tokens, mean_resizing=False)
    with torch.no_grad():
        for layer in (model.get_input_embeddings(), model.get_output_embeddings()):
            if layer is None:
                continue
            w = layer.weight  # a tied output layer is the same tensor: writing it twice is harmless
            bias = getattr(layer, "bias", None)
            for i in range(old, n_tokens):
                src = copies.get(i)
                w[i] = w[src] if src is not None and src < old else w[:old].mean(0)
                if bias is not None:
                    bias[i] = bias[src] if src is not None and src < old else bias[:old].mean()
    model.config.vocab_size = n_tokens


def build_text_dt(config: TextDTConfig, data: Any):
    """The policy (a trainable copy of the reference, or LoRA adapters on it) and
    :class:`~offline_plugins.objectives.llm.text_dt.TextDTLoss`, conditioned on
    ``config.target_return``. ``data`` is left as loaded: the reward tokens go into a copy of its
    tokenizer, the grown embeddings into a copy of its reference, and the round's
    :class:`~offline_plugins.algorithms.base.RolloutPlan` names the conditioned prompt source,
    that reference and that tokenizer (module docstring)."""
    from offline_plugins.algorithms._glue import require_rollouts
    from offline_plugins.algorithms.base import AlgorithmParts, OptimizerGroup, RolloutPlan
    from offline_plugins.objectives.llm.text_dt import TextDTLoss
    from offline_plugins.text.backends.generation import model_context
    from offline_plugins.text.data.rollouts import RolloutError
    from offline_plugins.tokens import prompt_token_ids

    require_rollouts(data, "text-dt")
    levels, target = _check_levels(config)
    w = config.low_return_weight
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= float(w) <= 1:
        raise UserError(f"text-dt: low_return_weight must be a number in [0, 1], got {w!r}; fix it with "
                        "--set low_return_weight=1 (every row, the Decision Transformer)")
    config.return_levels, config.target_return = tuple(levels), target  # the run's summary records them
    tokenizer = copy.deepcopy(data.tokenizer)
    texts = [return_token(x) for x in levels]
    missing = [t for t in texts if t not in tokenizer.get_vocab()]
    if missing:
        tokenizer.add_tokens(missing, special_tokens=True)
    ids = tokenizer.convert_tokens_to_ids(texts)
    for text, i in zip(texts, ids):
        encoded = tokenizer(text, add_special_tokens=False)["input_ids"]
        if list(encoded) != [i]:
            raise UserError(f"text-dt: the tokenizer splits the reward token {text!r} into {list(encoded)}; "
                            "use a tokenizer that accepts added special tokens (transformers' fast tokenizers do)")
    if getattr(tokenizer, "chat_template", None) is None and tokenizer.bos_token is not None:
        tokenizer.chat_template = CHAT_TEMPLATE
    target_id = ids[levels.index(target)]
    reference = copy.deepcopy(data.reference)
    _grow_embeddings(reference, len(tokenizer), {target_id: tokenizer.bos_token_id})
    reference.requires_grad_(False)
    source = conditioned_source(data.source, return_token(target), texts)
    # the data sized its rows from the unconditioned longest prompt; the run's collector is sized for these
    longest = max((len(prompt_token_ids(tokenizer, p)) for p in source.longest_prompts), default=1)
    budget, context = data.settings.max_new_tokens, model_context(data.reference)
    if longest + budget > context:
        worst = max(source.longest_prompts, key=lambda p: len(prompt_token_ids(tokenizer, p)))
        raise RolloutError(
            f"text-dt: the conditioned prompt {worst!r:.80} is {longest} tokens; with max_new_tokens="
            f"{budget} it exceeds the model's context of {context} tokens; lower "
            "max_new_tokens (--set max_new_tokens=...) or shorten the prompts")
    prefixed = prompt_token_ids(tokenizer, source.longest_prompts[0]) if source.longest_prompts else []
    if prefixed.count(target_id) != 1:
        raise UserError(f"text-dt: the tokenizer's chat template drops or repeats the reward token "
                        f"{return_token(target)!r} ({source.longest_prompts[0]!r:.60} -> {prefixed}); use a template "
                        "that keeps the user's text")

    # a trainable copy of the grown reference, or LoRA adapters on it (config.lora_r; the embedding rows of
    # the reward tokens then stay at their initial values and only the adapters learn to read them)
    policy, reference = policy_and_reference(config, data, "text-dt", reference=reference)
    actor = policy_log_probs(config, policy, "text-dt")
    loss = TextDTLoss(actor, return_token_ids=ids, return_levels=levels, target_return=target,
                      return_token_texts=texts, low_return_weight=float(w))
    group = OptimizerGroup("policy", list(policy.parameters()), resolve_lr(config, data, "text-dt"), ("loss_nll",),
                           max_grad_norm=config.max_grad_norm)
    rollout = RolloutPlan.of(loss, epochs=config.ppo_epochs, source=source, reference=reference, tokenizer=tokenizer)
    return AlgorithmParts(loss=loss, policy=actor, optimizers=[group], model=policy, tokenizer=tokenizer,
                          rollout=rollout, extra={"return_tokens": dict(zip(levels, texts)), "target_return": target})


@hookimpl
def offline_plugins_register_algorithms(registry):
    registry.add(
        AlgorithmSpec(
            name="text-dt",
            summary="Return-conditioned generation (Decision Transformer on text): reward tokens, hindsight "
                    "relabelling, NLL, conditioned on the best return",
            family="online-llm",
            data="text-rollouts",
            loss="offline_plugins.objectives.llm.text_dt:TextDTLoss",
            build="offline_plugins.algorithms.text_dt:build_text_dt",
            config=TextDTConfig,
            paper="Chen et al. 2021, Decision Transformer: Reinforcement Learning via Sequence Modeling, "
                  "arXiv:2106.01345; Zheng et al. 2022, Online Decision Transformer, arXiv:2202.05607; Lu et al. "
                  "2022, Quark: Controllable Text Generation with Reinforced Unlearning, arXiv:2205.13636",
            action_spaces=("tokens",),
            experimental="on the built-in task the reward token steers nothing (asked for return 0 the policy answers "
                         "as asked for 1) and the default low_return_weight=1 degrades the reference; the token is "
                         "learnt when low returns differ systematically (docs/results-history.md, 'Return-conditioned "
                         "generation')",
        )
    )
