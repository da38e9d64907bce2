"""Our online LLM losses trained on rollouts from TorchRL's own LLM stack.

Run: ``OMP_NUM_THREADS=1 python examples/torchrl_llm_pipeline.py --loss dapo --rounds 10`` (``--loss`` one of
dapo, dr-grpo, rloo, ppo-rlhf, online-dpo); prints the mean reward of each round's rollouts.

What is TorchRL's (0.14) here, used as its GRPO recipe (``sota-implementations/grpo``) uses it:

* ``ChatEnv.from_dataloader`` (a ``DatasetChatEnv``: ``ChatEnv`` + ``DataLoadingPrimer``) serves the
  arithmetic prompts in ``input_mode="text"``, each prompt ``repeats=G`` times in a row;
* ``TransformersWrapper`` around the tiny causal LM samples the responses (``generate=True``);
* ``LLMCollector`` steps the env with that policy, one dialog turn per env row;
* ``ReplayBuffer`` + ``LazyStackStorage`` hold the rows; ``MCAdvantage``, the buffer's write
  transform, holds rows until their prompt's group of ``G`` is complete, writes the group at
  once (contiguous) with TorchRL's group-normalised advantage, and for DAPO drops the groups whose
  rewards are all equal (``keep_return_bounds``: DAPO's dynamic sampling).

What is ours: the reward transform :class:`TaskReward` (a TorchRL ``Transform`` scoring with
``ArithmeticTask.rewards``), the bridge :func:`torchrl_rows_to_ted`, and the losses, unchanged:
``DAPOLoss``, ``DrGRPOLoss``, ``RLOOLoss``, ``PPORLHFLoss`` and ``OnlinePreferenceLoss`` (DPO inside),
with :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs` as their actor (sharing the
wrapper's weights, so the next round samples from the trained policy).

How TorchRL's collector rows differ from our TED text layout, and the bridge for each
(:func:`torchrl_rows_to_ted`, once per round, outside the gradient step):

1. Batch ``[N, 1]`` (env rows x dialog turns) -> ``[N]``: one row per single-turn rollout.
2. ``("tokens", "full")``: TorchRL left-pads the prompt (the batched ``generate`` needs it) and
   right-pads the response after eos: ``[pad.. prompt response pad..]``. Ours is right-padded
   ``[prompt response pad..]``: each row is shifted left by its number of prompt pads (a gather).
   Without it, ``CausalLMLogProbs`` (right-padded rows, no mask, positions from 0) would read a
   padded prompt at shifted positions.
3. ``("masks", "all_assistant_mask")``: ``None`` in text mode; ours is built from the prompt width
   (``("tokens", "prompt")`` is ``[N, Tp]``, left-padded): real tokens at or after ``Tp``.
4. ``("log_probs", ...)``: TorchRL's text-mode generate writes only ``("log_probs", "response")``
   (``full`` is ``None``), sets the first response token's log-prob to 0, and also scores the pad
   positions after eos (``pad_output=True``: about -14 there). Our ratio needs the
   sampling policy's log-prob of every response token aligned with ``tokens.full``: one no-grad
   scoring forward of the policy writes ``("log_probs", "full")``; the reference's writes
   ``("next", "ref_log_probs", "full")`` (TorchRL's way is a ``RetrieveLogProb``/``KLRewardTransform``
   env transform calling a reference wrapper; the same forward either way).
5. ``("next", "reward")``: TorchRL's LLM reward parsers (e.g. ``GSM8KRewardParser``) write
   ``batch + (1, 1)``, and so does :class:`TaskReward`; the collector makes it ``[N, 1, 1, 1]``
   (``ChatEnv`` itself declares no reward). Ours is ``[N, 1]``: a reshape.
   ``("next", "done")`` must be True (single-turn) for ``MCAdvantage`` to take the rows.
6. ``"group"``: ours is an integer prompt id; TorchRL groups by the prompt text
   (``MCAdvantage(prompt_key=("text", "prompt"))``): ids are numbered from the prompts.
7. ``"advantage"``: ``MCAdvantage`` writes one value per row shaped like the reward; ours is
   ``[N, T, 1]`` on the response tokens: broadcast over the response mask (DAPO). Its std is the
   Bessel one (ours the population one): TorchRL's advantages are ours times ``sqrt((G - 1) / G)``. Dr. GRPO and RLOO
   are defined by their estimators (unscaled, leave-one-out with the KL in the reward), which
   MCAdvantage does not give: their own ``process_rollouts`` writes the advantage instead.
   PPO-RLHF's GAE needs no group (no MCAdvantage); online DPO reads MCAdvantage's contiguous groups
   through ``pair_rollouts``.
8. Text: our prompts start with bos (``offline_plugins.tokens.prompt_token_ids``, what the SFT saw);
   ``ChatEnv`` renders the prompt through a chat template, given one that writes ``bos_token`` then
   the message as is. ``("text", "response")`` keeps special tokens (``skip_special_tokens=False``):
   the reward transform strips the bos and eos texts before scoring.
9. The wrapper's response mask is ``tokens != pad_token_id``: a response that sampled the pad token
   would get a hole in ``all_attention_mask`` (our rows are one contiguous run of real tokens). The
   policy never samples pad (``generate_kwargs={"bad_words_ids": [[pad]]}``); our log-probs score the
   model's raw distribution, as the wrapper's do, where an SFT'd model gives pad ~0 probability.
"""

from __future__ import annotations

import argparse
import copy
from typing import Optional

import torch
from tensordict import TensorDict, TensorDictBase, set_list_to_stack

LOSSES = ("dapo", "dr-grpo", "rloo", "ppo-rlhf", "online-dpo")
#: Adam learning rates, measured on this task over 3 seeds: at 1e-3 the k3 KL of a minibatch jumps to
#: 10-100 nats and the reward falls; Dr. GRPO's unscaled advantages over a constant length normaliser
#: give about half GRPO's gradient, so twice the rate; DPO's pairwise loss gets a third
LEARNING_RATES = {"dapo": 3e-4, "dr-grpo": 6e-4, "rloo": 3e-4, "ppo-rlhf": 3e-4, "online-dpo": 1e-4}
#: responses per prompt: online DPO learns from one best-vs-worst pair per prompt, and with 4 responses
#: most groups of this task are all right (no pair); 8 gave it a steadier rise (3 seeds)
GROUP_SIZES = {"dapo": 4, "dr-grpo": 4, "rloo": 4, "ppo-rlhf": 4, "online-dpo": 8}
#: the prompt is bos + the message's text: the tiny model was fine-tuned on "<bos>12+34=" -> "46<eos>"
#: (``offline_plugins.tokens.prompt_token_ids``: bos first when the tokenizer has no chat template)
PLAIN_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _strings(value) -> list[str]:
    """A stack of strings (``NonTensorStack``, nested list or str) as a flat list of str."""
    value = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(value, str):
        return [value]
    return [s for v in value for s in _strings(v)]


# -- TorchRL's env, with our reward ----------------------------------------------------------
def _transform_base():
    from torchrl.envs import Transform

    return Transform


class TaskReward(_transform_base()):
    """Scores ``("text", "response")`` against ``("text", "prompt")`` with ``task.rewards``; ends the episode.

    Writes ``reward`` as TorchRL's LLM reward parsers do (``batch + (1, 1)``) and ``done`` /
    ``terminated`` True (one turn per episode).
    """

    def __init__(self, task, eos_text: Optional[str], bos_text: Optional[str] = None) -> None:
        super().__init__(in_keys=[("text", "prompt"), ("text", "response")], out_keys=["reward"])
        self.task = task
        self.eos_text = eos_text
        self.bos_text = bos_text

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        prompts = _strings(tensordict.get(("text", "prompt")))
        responses = _strings(tensordict.get(("text", "response")))
        if self.bos_text:
            prompts = [p.removeprefix(self.bos_text) for p in prompts]
        if self.eos_text:
            responses = [r.split(self.eos_text)[0] for r in responses]
        shape = tuple(next_tensordict.batch_size)
        reward = torch.tensor(self.task.rewards(prompts, responses), dtype=torch.float32)
        next_tensordict.set("reward", reward.reshape(*shape, 1, 1).to(next_tensordict.device))
        done = torch.ones(*shape, 1, dtype=torch.bool, device=next_tensordict.device)
        next_tensordict.set("done", done)
        next_tensordict.set("terminated", done.clone())
        return next_tensordict

    def transform_reward_spec(self, reward_spec):
        from torchrl.data import Composite, Unbounded

        reward_spec.update(Composite(reward=Unbounded(reward_spec.shape + (1, 1)), shape=reward_spec.shape))
        return reward_spec


class _PromptLoader:
    """An endless loader of ``batch_size`` task prompts per batch, reproducible from ``seed``.

    ``pool``: draw every batch from one fixed set of ``pool`` train problems (a shuffle of it per batch;
    ``pool == batch_size``: the same prompts every round, so a round's mean reward moves with the policy
    only, not with which prompts it drew); None: fresh problems every batch.
    """

    def __init__(self, task, batch_size: int, seed: int, pool: Optional[int] = None) -> None:
        self.task, self.batch_size, self.seed = task, batch_size, seed
        self.pool = None if pool is None else task.problems(pool, split="train", seed=seed)

    def __iter__(self):
        rng = torch.Generator().manual_seed(self.seed)
        i = 0
        while True:
            if self.pool is None:
                problems = self.task.problems(self.batch_size, split="train", seed=self.seed * 100_003 + i)
            else:
                order = torch.randperm(len(self.pool), generator=rng).tolist()
                problems = [self.pool[j] for j in (order * self.batch_size)[:self.batch_size]]
            i += 1
            yield {"query": [p.prompt for p in problems], "answer": [p.answer for p in problems]}


def make_env(task, tokenizer, *, prompts_per_round: int, group_size: int, seed: int = 0, pool: Optional[int] = None):
    """TorchRL's ``ChatEnv`` fed by a ``DataLoadingPrimer`` (each prompt ``group_size`` times in a row),
    plus :class:`TaskReward`; batch ``prompts_per_round * group_size``."""
    from torchrl.envs.llm import ChatEnv

    env = ChatEnv.from_dataloader(_PromptLoader(task, prompts_per_round, seed, pool), repeats=group_size,
                                  batch_size=(prompts_per_round * group_size,), tokenizer=tokenizer,
                                  input_mode="text", template_kwargs={"chat_template": PLAIN_TEMPLATE})
    return env.append_transform(TaskReward(task, tokenizer.eos_token, tokenizer.bos_token))


def make_policy(model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0):
    """TorchRL's ``TransformersWrapper`` sampling from ``model`` (text in, text + tokens out)."""
    from torchrl.modules.llm import TransformersWrapper

    return TransformersWrapper(model, tokenizer=tokenizer, input_mode="text", generate=True, return_log_probs=True,
                               pad_output=True, generate_kwargs={"max_new_tokens": max_new_tokens, "do_sample": True,
                                                                 "temperature": temperature,
                                                                 # see the module docstring, 9.
                                                                 "bad_words_ids": [[tokenizer.pad_token_id]]})


# -- the bridge ----------------------------------------------------------------------------
def right_align(tokens: torch.Tensor, attention_mask: torch.Tensor, n_left: torch.Tensor, pad_id: int):
    """Shift each row left by ``n_left`` (its leading pads): ``[pad.. x..]`` -> ``[x.. pad..]``."""
    t = tokens.shape[-1]
    idx = torch.arange(t, device=tokens.device).unsqueeze(0) + n_left.unsqueeze(-1)
    valid = idx < t
    idx = idx.clamp(max=t - 1)
    out = torch.where(valid, tokens.gather(-1, idx), torch.full_like(tokens, pad_id))
    return out, valid & attention_mask.gather(-1, idx)


@torch.no_grad()
def torchrl_rows_to_ted(data: TensorDictBase, *, pad_id: int, policy_scorer, reference_scorer) -> TensorDict:
    """TorchRL collector rows ``[N, 1]`` -> our TED text rows ``[N]`` (see the module docstring, 1-8)."""
    data = data.reshape(-1)  # 1. [envs, turns] -> rows
    full = data.get(("tokens", "full"))
    attn = data.get(("masks", "all_attention_mask")).bool()
    prompt_width = data.get(("tokens", "prompt")).shape[-1]
    pos = torch.arange(full.shape[-1], device=full.device)
    response = attn & (pos >= prompt_width)  # 3. the assistant mask text mode leaves None
    n_left = (~attn[:, :prompt_width]).sum(-1)  # 2. left padding of each prompt
    tokens, attn_r = right_align(full, attn, n_left, pad_id)
    response_r, _ = right_align(response.long(), attn, n_left, 0)
    response_r = response_r.bool() & attn_r
    n = full.shape[0]
    prompts = _strings(data.get(("text", "prompt")))
    ids: dict[str, int] = {}
    group = torch.tensor([ids.setdefault(p, len(ids)) for p in prompts], device=full.device)  # 6.
    done = torch.ones(n, 1, dtype=torch.bool, device=full.device)
    td = TensorDict({
        "tokens": {"full": tokens},
        "masks": {"all_attention_mask": attn_r, "all_assistant_mask": response_r},
        # 4. per-token log-probs aligned with tokens.full, of the sampling policy and the reference
        "log_probs": {"full": policy_scorer.log_probs(tokens, attn_r)},
        "next": {"reward": data.get(("next", "reward")).reshape(n, 1),  # 5.
                 "done": done, "terminated": done.clone(),
                 "ref_log_probs": {"full": reference_scorer.log_probs(tokens, attn_r)}},
        "group": group,
    }, batch_size=[n], device=full.device)
    td.set(("text", "prompt"), prompts)
    td.set(("text", "response"), _strings(data.get(("text", "response"))))
    return td


def advantage_on_tokens(td: TensorDictBase) -> TensorDictBase:
    """7. MCAdvantage's one advantage per row -> ``[N, T, 1]`` on the response tokens."""
    mask = td.get(("masks", "all_assistant_mask"))
    adv = td.get("advantage").reshape(-1, 1).to(torch.float32)
    td.set("advantage", (adv * mask.to(adv.dtype)).unsqueeze(-1))
    return td


# -- our losses -----------------------------------------------------------------------------
def make_loss(name: str, policy_model, reference_model, *, group_size: int, max_new_tokens: int):
    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.objectives.llm.online import DAPOLoss, DrGRPOLoss, RLOOLoss

    actor = CausalLMLogProbs(policy_model)
    if name == "dapo":
        return DAPOLoss(actor, max_new_tokens=max_new_tokens)
    if name == "dr-grpo":
        return DrGRPOLoss(actor, length_normalizer=max_new_tokens)
    if name == "rloo":
        return RLOOLoss(actor)
    if name == "ppo-rlhf":
        from offline_plugins.objectives.llm.ppo_rlhf import PPORLHFLoss, TokenValueHead

        return PPORLHFLoss(actor, TokenValueHead(copy.deepcopy(reference_model).requires_grad_(True)))
    if name == "online-dpo":
        from offline_plugins.objectives.llm import DPOLoss
        from offline_plugins.objectives.llm.online_dpo import OnlinePreferenceLoss

        return OnlinePreferenceLoss(DPOLoss(actor, reduction="none"), group_size=group_size)
    raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {name!r}")


def make_grouping_buffer(name: str, group_size: int, capacity: int):
    """TorchRL's buffer with ``MCAdvantage`` (groups by prompt text; DAPO: drops all-equal groups)."""
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm.grpo import MCAdvantage

    kwargs = {}
    if name == "dapo":  # dynamic sampling: keep a group only if its mean reward is strictly inside (0, 1)
        kwargs = {"trajectory_return": "sum", "keep_return_bounds": (0.0, 1.0)}
    buffer = ReplayBuffer(storage=LazyStackStorage(capacity))
    buffer.append_transform(MCAdvantage(grpo_size=group_size, prompt_key=("text", "prompt"), **kwargs))
    return buffer


def sft_policy(task, *, steps: int, seed: int = 0, cache_dir=None):
    """The tiny LM after ``steps`` of SFT on the task (the reference and the policy's start)."""
    from offline_plugins.data.rollouts import sft_reference
    from offline_plugins.lightning.sft import supervised_finetune

    return sft_reference(task, steps=steps, seed=seed, batch_size=32, cache_dir=cache_dir,
                         finetune=supervised_finetune)


def train(loss_name: str, *, rounds: int = 10, seed: int = 0, prompts_per_round: int = 16,
          group_size: Optional[int] = None,
          max_new_tokens: int = 4, epochs: int = 4, minibatch: int = 16, lr: Optional[float] = None,
          sft_steps: int = 300, digits: int = 1, pool: Optional[int] = 16,
          reference=None, verbose: bool = True) -> list[float]:
    """Train ``loss_name`` for ``rounds`` rounds of TorchRL rollouts; returns each round's mean reward.

    ``reference``: an SFT'd ``(model, tokenizer)`` to start from (copied); built if None. ``lr`` and
    ``group_size``: None is the loss's entry in :data:`LEARNING_RATES`, :data:`GROUP_SIZES`. The task is
    1-digit addition (``digits``): 300 SFT steps reach ~0.6 reward at temperature 1, so RL has room to
    raise it; ``pool=16`` prompts (the same every round, see :class:`_PromptLoader`) make the per-round
    mean a clean signal. DAPO's overlong penalty is off (``overlong_cache=0``): MCAdvantage reads the
    raw ``("next", "reward")``, so a penalty would have to be added to the reward before the buffer.
    """
    if loss_name not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss_name!r}")
    lr = LEARNING_RATES[loss_name] if lr is None else lr
    group_size = GROUP_SIZES[loss_name] if group_size is None else group_size
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement

    from offline_plugins.envs.tasks import ArithmeticTask
    from offline_plugins.modules.causal_lm import CausalLMLogProbs

    set_list_to_stack(True).set()
    task = ArithmeticTask(digits=digits, ops="+")
    if reference is None:
        reference = sft_policy(task, steps=sft_steps, seed=seed)
    ref_model, tokenizer = reference
    ref_model = copy.deepcopy(ref_model).eval().requires_grad_(False)
    model = copy.deepcopy(ref_model).requires_grad_(True)
    torch.manual_seed(seed)

    rows = prompts_per_round * group_size
    env = make_env(task, tokenizer, prompts_per_round=prompts_per_round, group_size=group_size, seed=seed,
                   pool=pool)
    collector = LLMCollector(env, policy=make_policy(model, tokenizer, max_new_tokens=max_new_tokens),
                             dialog_turns_per_batch=rows, total_dialog_turns=rows * rounds)
    loss = make_loss(loss_name, model, ref_model, group_size=group_size, max_new_tokens=max_new_tokens)
    optim = torch.optim.Adam([p for p in loss.parameters() if p.requires_grad], lr=lr)
    scorer, ref_scorer = CausalLMLogProbs(model), CausalLMLogProbs(ref_model)
    rewards: list[float] = []
    for r, data in enumerate(collector):
        model.eval()
        ted = torchrl_rows_to_ted(data, pad_id=tokenizer.pad_token_id, policy_scorer=scorer,
                                  reference_scorer=ref_scorer)
        rewards.append(float(ted.get(("next", "reward")).mean()))  # once per round, for the printout
        if verbose:
            print(f"round {r}: mean reward {rewards[-1]:.3f}", flush=True)
        if loss_name == "ppo-rlhf":
            batch = loss.process_rollouts(ted)  # GAE on a value head: no group needed
        else:
            grouping = make_grouping_buffer(loss_name, group_size, rows)
            grouping.extend(ted)
            if len(grouping) == 0:  # DAPO: every group without signal, nothing to learn this round
                continue
            batch = grouping[:]
            batch = advantage_on_tokens(batch) if loss_name == "dapo" else loss.process_rollouts(batch)
            if loss_name == "online-dpo":
                batch = loss.pair_rollouts(batch)
        train_buffer = ReplayBuffer(storage=LazyStackStorage(batch.shape[0]), sampler=SamplerWithoutReplacement(),
                                    batch_size=max(1, minibatch // (2 if loss_name == "online-dpo" else 1)))
        train_buffer.extend(batch)
        model.train()
        for _ in range(epochs):
            for mb in train_buffer:
                out = loss(mb)
                total = sum(v for k, v in out.items() if k.startswith("loss_"))
                optim.zero_grad()
                total.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optim.step()
    collector.shutdown()
    return rewards


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loss", choices=LOSSES, default="dapo")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=300, help="SFT steps of the reference on the task")
    parser.add_argument("--lr", type=float, default=None, help="Adam learning rate (default: per loss)")
    args = parser.parse_args(argv)
    return train(args.loss, rounds=args.rounds, seed=args.seed, sft_steps=args.sft_steps, lr=args.lr)


if __name__ == "__main__":
    main()
