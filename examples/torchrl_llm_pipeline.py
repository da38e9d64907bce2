"""Our online LLM losses trained on rollouts from TorchRL's own LLM stack, through the package's bridge.

Run: ``OMP_NUM_THREADS=1 python examples/torchrl_llm_pipeline.py --loss dapo --rounds 10`` (``--loss`` one of
dapo, dr-grpo, rloo, ppo-rlhf, online-dpo, opd; ``--model`` tiny (default) or any model with a chat template,
e.g. small; ``--input-mode`` text (default) or history); prints the mean reward of each round's rollouts.

The user code is :func:`train`'s loop: TorchRL's ``ChatEnv`` (prompts of a ``DataLoadingPrimer``, each
``G`` times in a row) with our :class:`~offline_plugins.torchrl_llm.TaskReward`; TorchRL's
``TransformersWrapper`` sampling from the policy; ``LLMCollector``; a ``ReplayBuffer`` whose write
transforms are TorchRL's ``MCAdvantage`` (groups by prompt, GRPO's advantage; DAPO: drops the groups with
no signal) and our :class:`~offline_plugins.torchrl_llm.FromTorchRLRows` (TorchRL's rows -> our layout, the
advantage on the response tokens); our loss; an Adam loop. What the bridge changes and why is the
docstring of :mod:`offline_plugins.torchrl_llm`.

Per loss: DAPO trains on MCAdvantage's advantage (TorchRL's Bessel std: ours times ``sqrt((G - 1) / G)``);
Dr. GRPO and RLOO are defined by their estimators (unscaled; leave-one-out), so their own
``process_rollouts`` rewrites it; online DPO pairs MCAdvantage's contiguous groups (``pair_rollouts``);
PPO-RLHF (GAE on a value head) and OPD need no group: the transform is called on the batch. OPD's teacher is
the same model after more SFT steps on the task (``--teacher-sft-steps``), as the package's ``opd`` takes
any ``save_pretrained`` folder of the student's tokenizer.

Models: ``tiny`` has no chat template (it was fine-tuned on ``"<bos>12+34="``): in text mode the env renders
the prompt with :data:`PLAIN_TEMPLATE`; ``--input-mode history`` needs a chat template TorchRL can parse
back into a ``History`` (ChatML, as ``small``'s), so tiny is refused there. A model with a chat template
uses its own in both modes, passed to the env and the wrapper (TorchRL would otherwise pick its own
template from the model's name). The reward reads the user message (history) or the rendered prompt with
the template's text around the message removed (text).

The policy never samples the pad token (``bad_words_ids``): TorchRL's attention mask is ``tokens != pad``,
so a sampled pad would be a hole in the response.
"""

from __future__ import annotations

import argparse
import copy
from typing import Optional

import torch
from tensordict import set_list_to_stack

from offline_plugins.torchrl_llm import FromTorchRLRows, TaskReward

LOSSES = ("dapo", "dr-grpo", "rloo", "ppo-rlhf", "online-dpo", "opd")
INPUT_MODES = ("text", "history")
#: Adam learning rates, measured on this task over 3 seeds: at 1e-3 the k3 KL of a minibatch jumps to
#: 10-100 nats and the reward falls; Dr. GRPO's unscaled advantages over a constant length normaliser
#: give about half GRPO's gradient, so twice the rate; DPO's pairwise loss gets a third
LEARNING_RATES = {"dapo": 3e-4, "dr-grpo": 6e-4, "rloo": 3e-4, "ppo-rlhf": 3e-4, "online-dpo": 1e-4, "opd": 3e-4}
#: responses per prompt: online DPO learns from one best-vs-worst pair per prompt, and with 4 responses
#: most groups of this task are all right (no pair); 8 gave it a steadier rise (3 seeds)
GROUP_SIZES = {"dapo": 4, "dr-grpo": 4, "rloo": 4, "ppo-rlhf": 4, "online-dpo": 8, "opd": 4}
#: the prompt is bos + the message's text: the tiny model was fine-tuned on "<bos>12+34=" -> "46<eos>"
#: (``offline_plugins.tokens.prompt_token_ids``: bos first when the tokenizer has no chat template)
PLAIN_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


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


def chat_template_of(tokenizer, input_mode: str) -> str:
    """The template the env and the wrapper render with: the model's own, else :data:`PLAIN_TEMPLATE` (text mode)."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        return template
    if input_mode == "history":
        raise SystemExit("--input-mode history needs a model with a chat template TorchRL can parse back into a "
                         "History (ChatML), e.g. --model small; tiny has none: use --input-mode text")
    return PLAIN_TEMPLATE


def make_env(task, tokenizer, *, prompts_per_round: int, group_size: int, seed: int = 0, pool: Optional[int] = None,
             input_mode: str = "text"):
    """TorchRL's ``ChatEnv`` fed by a ``DataLoadingPrimer`` (each prompt ``group_size`` times in a row), plus our
    :class:`~offline_plugins.torchrl_llm.TaskReward`; batch ``prompts_per_round * group_size``."""
    from torchrl.envs.llm import ChatEnv

    template = chat_template_of(tokenizer, input_mode)
    env = ChatEnv.from_dataloader(_PromptLoader(task, prompts_per_round, seed, pool), repeats=group_size,
                                  batch_size=(prompts_per_round * group_size,), tokenizer=tokenizer,
                                  input_mode=input_mode, template_kwargs={"chat_template": template})
    return env.append_transform(TaskReward(task, tokenizer, chat_template=template))


def make_policy(model, tokenizer, *, max_new_tokens: int, temperature: float = 1.0, input_mode: str = "text"):
    """TorchRL's ``TransformersWrapper`` sampling from ``model``; never the pad token (module docstring)."""
    from torchrl.modules.llm import TransformersWrapper

    template = chat_template_of(tokenizer, input_mode) if input_mode == "history" else None
    return TransformersWrapper(model, tokenizer=tokenizer, input_mode=input_mode, generate=True, return_log_probs=True,
                               pad_output=True, chat_template=template,
                               generate_kwargs={"max_new_tokens": max_new_tokens, "do_sample": True,
                                                "temperature": temperature,
                                                "bad_words_ids": [[tokenizer.pad_token_id]]})

# -- our losses -----------------------------------------------------------------------------
def make_loss(name: str, policy_model, reference_model, *, group_size: int, max_new_tokens: int, teacher=None):
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
    if name == "opd":
        from offline_plugins.objectives.llm.distill import OnPolicyDistillationLoss

        return OnPolicyDistillationLoss(actor, teacher)
    raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {name!r}")


def make_grouping_buffer(name: str, group_size: int, capacity: int, bridge: FromTorchRLRows):
    """TorchRL's buffer; on write our bridge, then ``MCAdvantage`` (groups by prompt text; DAPO: drops the
    all-equal groups); on read the advantage on the response tokens."""
    from torchrl.data import LazyStackStorage, ReplayBuffer
    from torchrl.objectives.llm.grpo import MCAdvantage

    kwargs = {}
    if name == "dapo":  # dynamic sampling: keep a group only if its mean reward is strictly inside (0, 1)
        kwargs = {"trajectory_return": "sum", "keep_return_bounds": (0.0, 1.0)}
    buffer = ReplayBuffer(storage=LazyStackStorage(capacity))
    buffer.append_transform(MCAdvantage(grpo_size=group_size, prompt_key=("text", "prompt"), **kwargs))
    return buffer.append_transform(bridge, invert=True)  # the buffer runs write transforms last-first


def sft_policy(task, *, steps: int, seed: int = 0, model: str = "tiny", cache_dir=None):
    """``model`` after ``steps`` of SFT on the task (the reference and the policy's start; OPD's teacher)."""
    from offline_plugins.kinds.sft import supervised_finetune
    from offline_plugins.text.data.rollouts import sft_reference

    return sft_reference(task, model=model, steps=steps, seed=seed, batch_size=32, cache_dir=cache_dir,
                         finetune=supervised_finetune)


def train(loss_name: str, *, rounds: int = 10, seed: int = 0, prompts_per_round: int = 16,
          group_size: Optional[int] = None, max_new_tokens: int = 4, epochs: int = 4, minibatch: int = 16,
          lr: Optional[float] = None, sft_steps: int = 300, teacher_sft_steps: int = 1500, digits: int = 1,
          pool: Optional[int] = 16, model_name: str = "tiny", input_mode: str = "text", reference=None,
          teacher=None, verbose: bool = True) -> list[float]:
    """Train ``loss_name`` for ``rounds`` rounds of TorchRL rollouts; returns each round's mean reward.

    ``reference``: an SFT'd ``(model, tokenizer)`` to start from (copied); built from ``model_name`` if None.
    ``teacher``: OPD's teacher model (built with ``teacher_sft_steps`` if None). ``lr`` and ``group_size``:
    None is the loss's entry in :data:`LEARNING_RATES`, :data:`GROUP_SIZES`. The task is 1-digit addition
    (``digits``): 300 SFT steps of tiny reach ~0.6 reward at temperature 1, so RL has room to raise it;
    ``pool=16`` prompts (the same every round, see :class:`_PromptLoader`) make the per-round mean a clean
    signal. DAPO's overlong penalty is off (``overlong_cache=0``): MCAdvantage reads the raw reward.
    """
    if loss_name not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss_name!r}")
    if input_mode not in INPUT_MODES:
        raise ValueError(f"input_mode must be one of {', '.join(INPUT_MODES)}, got {input_mode!r}")
    lr = LEARNING_RATES[loss_name] if lr is None else lr
    group_size = GROUP_SIZES[loss_name] if group_size is None else group_size
    from torchrl.collectors.llm import LLMCollector
    from torchrl.data import LazyStackStorage, ReplayBuffer, SamplerWithoutReplacement

    from offline_plugins.modules.causal_lm import CausalLMLogProbs
    from offline_plugins.text.tasks import ArithmeticTask

    set_list_to_stack(True).set()
    task = ArithmeticTask(digits=digits, ops="+")
    if reference is None:
        reference = sft_policy(task, steps=sft_steps, seed=seed, model=model_name)
    ref_model, tokenizer = reference
    chat_template_of(tokenizer, input_mode)  # history mode without a chat template: refused before any work
    if loss_name == "opd" and teacher is None:
        teacher = sft_policy(task, steps=teacher_sft_steps, seed=seed, model=model_name)[0]
    ref_model = copy.deepcopy(ref_model).eval().requires_grad_(False)
    model = copy.deepcopy(ref_model).requires_grad_(True)
    torch.manual_seed(seed)

    rows = prompts_per_round * group_size
    env = make_env(task, tokenizer, prompts_per_round=prompts_per_round, group_size=group_size, seed=seed, pool=pool,
                   input_mode=input_mode)
    policy = make_policy(model, tokenizer, max_new_tokens=max_new_tokens, input_mode=input_mode)
    collector = LLMCollector(env, policy=policy, dialog_turns_per_batch=rows, total_dialog_turns=rows * rounds)
    loss = make_loss(loss_name, model, ref_model, group_size=group_size, max_new_tokens=max_new_tokens,
                     teacher=teacher)
    optim = torch.optim.Adam([p for p in loss.parameters() if p.requires_grad], lr=lr)
    # TorchRL rows -> our layout; the scorers write the sampling policy's and the reference's log-probs
    bridge = FromTorchRLRows(pad_id=tokenizer.pad_token_id, eos_id=tokenizer.eos_token_id, tokenizer=tokenizer,
                             policy_scorer=CausalLMLogProbs(model), reference_scorer=CausalLMLogProbs(ref_model))
    rewards: list[float] = []
    for r, data in enumerate(collector):
        model.eval()
        rewards.append(float(data.get(("next", "reward")).mean()))  # once per round, for the printout
        if verbose:
            print(f"round {r}: mean reward {rewards[-1]:.3f}", flush=True)
        if loss_name in ("ppo-rlhf", "opd"):  # no group: convert the batch, then the loss's round hook
            batch = loss.process_rollouts(bridge(data))
        else:
            grouping = make_grouping_buffer(loss_name, group_size, rows, bridge)
            grouping.extend(data)
            if len(grouping) == 0:  # DAPO: every group without signal, nothing to learn this round
                continue
            batch = grouping[:]
            if loss_name != "dapo":  # Dr. GRPO, RLOO, online DPO: their own estimator (module docstring)
                batch = loss.process_rollouts(batch)
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
    parser.add_argument("--model", default="tiny", help="tiny, small, or a folder / hub id of a model with a chat "
                                                        "template (offline_plugins.modules.tiny_lm.load_causal_lm)")
    parser.add_argument("--input-mode", choices=INPUT_MODES, default="text", help="ChatEnv's and the wrapper's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-steps", type=int, default=300, help="SFT steps of the reference on the task")
    parser.add_argument("--teacher-sft-steps", type=int, default=1500, help="SFT steps of OPD's teacher")
    parser.add_argument("--lr", type=float, default=None, help="Adam learning rate (default: per loss)")
    args = parser.parse_args(argv)
    return train(args.loss, rounds=args.rounds, seed=args.seed, sft_steps=args.sft_steps, lr=args.lr,
                 teacher_sft_steps=args.teacher_sft_steps, model_name=args.model, input_mode=args.input_mode)


if __name__ == "__main__":
    main()
