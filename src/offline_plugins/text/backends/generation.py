"""Batched generation from a causal LM: left-padded prompts, sampled log-probs, greedy decoding.

One path for every response this package generates: the rollout collector's samples (with
the per-token log-probs of the sampled tokens), the preference data's samples and the
held-out greedy answers that exact match scores. Prompts come as token ids (tokenising is
the caller's, :func:`offline_plugins.tokens.prompt_token_ids`); they are left-padded into one
batch whose rows keep their own positions (:func:`generate_left_padded`), so a batch
generates what one prompt at a time would.

Why a clean ``GenerationConfig`` rather than the model's own: a processor from the model's
``generation_config`` (a repetition penalty, a forced token) would make the samples
off-policy for the losses and the greedy answers not the model's argmax.

>>> import torch
>>> from offline_plugins.modules.tiny_lm import load_causal_lm
>>> model, tok = load_causal_lm("tiny", seed=0)
>>> out = generate(model, [[1, 5, 6], [1, 7]], pad_id=tok.pad_token_id, eos_id=tok.eos_token_id,
...                max_new_tokens=3, num_samples=2, seed=0, log_probs=True)
>>> out.tokens.shape[0], out.log_probs.shape == out.tokens.shape, len(out.texts(tok))
(4, True, 4)
>>> bool((out.log_probs <= 0).all())
True
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import GenerationConfig, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from offline_plugins.tokens import pad_token_id, prompt_token_ids

__all__ = ["model_context", "left_pad", "generate_left_padded", "SampledLogProbs", "Generation", "generate",
           "generation_kwargs", "generate_texts", "greedy_responses", "DEFAULT_CONTEXT"]

#: the context of a model whose config names none (a plain module): GPT-2's
DEFAULT_CONTEXT = 1024


def model_context(model: Any, *, cap: Optional[int] = None) -> int:
    """The longest sequence ``model`` reads: its config's ``max_position_embeddings``
    (``n_positions`` for GPT-2-style configs, the same number under another name), else
    :data:`DEFAULT_CONTEXT`; at most ``cap`` when given.

    The rollout budget (prompt + ``max_new_tokens``) is checked against the model's own
    context, uncapped: its width is exact. A caller that pads every row to this length (the
    preference loader's ``max_length``) passes a ``cap``, so a 32k-context hub model does not
    pad each pair to 32k tokens.

    >>> model_context(torch.nn.Linear(2, 2)), model_context(torch.nn.Linear(2, 2), cap=512)
    (1024, 512)
    """
    config = getattr(model, "config", None)
    n = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    n = int(n) if n else DEFAULT_CONTEXT
    return min(n, int(cap)) if cap is not None else n


def left_pad(prompt_ids: Sequence[Sequence[int]], pad_id: int, *, repeat: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` ``[len(prompt_ids) * repeat, width]``: each prompt ``repeat``
    times in a row (row ``i * repeat + j``), padded on the left to the longest.

    >>> left_pad([[5, 6], [7]], 0, repeat=2)[0].tolist()
    [[5, 6], [5, 6], [0, 7], [0, 7]]
    """
    width = max(len(e) for e in prompt_ids)
    n = len(prompt_ids) * repeat
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attn = torch.zeros(n, width, dtype=torch.long)
    for i, e in enumerate(prompt_ids):
        for j in range(repeat):
            ids[i * repeat + j, width - len(e):] = torch.tensor(e)
            attn[i * repeat + j, width - len(e):] = 1
    return ids, attn


def generate_left_padded(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         **kwargs) -> torch.Tensor:
    """``model.generate`` on left-padded prompts with each row's positions counted from its first real token.

    transformers derives ``position_ids`` from the attention mask only when the model's
    ``forward`` names ``position_ids`` in its signature; a wrapper whose ``forward`` takes
    ``**kwargs`` gets positions counted from the padding instead, so a prompt padded by ``k``
    tokens is read ``k`` positions late: a different model from the one the losses score
    (right-padded, positions from 0). Measured on the built-in task's SFT reference before the
    tiny model named ``position_ids``: greedy held-out exact match 75.5 % left-padded in batches
    against 88.0 % one prompt at a time, and the sampling log-probs of padded rows off by up to
    13 nats from the scoring forward's
    (``tests/test_online_train.py::test_left_padding_samples_the_scored_model``). Here the
    positions are passed explicitly whenever transformers would not derive them.
    """
    params = inspect.signature(model.forward).parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    is_enc_dec = bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False))
    if "position_ids" not in params and takes_kwargs and not is_enc_dec and "position_ids" not in kwargs:
        kwargs["position_ids"] = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    if "synced_gpus" not in kwargs and _sharded_across_ranks(model):
        # an FSDP-sharded model gathers its weights in every forward: the ranks take the same number
        # of decoding steps, to the longest of theirs (transformers' synced_gpus)
        kwargs["synced_gpus"] = True
    return model.generate(input_ids=input_ids, attention_mask=attention_mask, **kwargs)


def _sharded_across_ranks(model: torch.nn.Module) -> bool:
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False

    # an FSDP2-sharded model (or a LoRA reference holding one's parameters)
    return any(isinstance(p, DTensor) for p in model.parameters())


class SampledLogProbs:
    """Records, during ``generate``, the policy's log-prob of each token it samples.

    A ``LogitsProcessor`` that runs first, on the model's raw next-token logits: at step
    ``t + 1`` it gathers, from step ``t``'s log-softmax, the token ``generate`` chose at
    ``t``; :meth:`finish` gathers the last one. The log-probs are those of the model's own
    distribution (not the temperature / top-p warped one it samples from), as
    :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs` scores them for the losses'
    ratio, so the collector needs no second forward of the policy over the rollouts. It
    holds one step's ``[N, V]`` log-softmax at a time, where ``output_logits=True`` would
    keep every step's logits until ``generate`` returns.
    """

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []
        self._last: Optional[torch.Tensor] = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._last is not None:
            self.steps.append(self._last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._last = scores.float().log_softmax(-1)
        return scores

    def finish(self, generated: torch.Tensor) -> torch.Tensor:
        """``[N, K]`` log-probs of the ``K`` generated tokens (garbage after a row's eos: mask them)."""
        if self._last is not None and len(self.steps) < generated.shape[1]:
            self.steps.append(self._last.gather(-1, generated[:, len(self.steps):len(self.steps) + 1]).squeeze(-1))
        self._last = None
        if not self.steps:
            return generated.new_zeros(generated.shape, dtype=torch.float32)
        return torch.stack(self.steps, 1)


def generation_kwargs(*, max_new_tokens: int, pad_id: int, eos_id: Optional[int], greedy: bool = False,
                      temperature: float = 1.0, top_p: float = 1.0,
                      recorder: Optional[SampledLogProbs] = None) -> dict[str, Any]:
    """``generate``'s arguments: a clean config (see the module docstring), and for sampling the
    log-prob ``recorder`` first, then transformers' temperature and top-p warpers."""
    processors = [recorder] if recorder is not None else []
    if not greedy and temperature != 1.0:
        processors.append(TemperatureLogitsWarper(temperature))
    if not greedy and top_p < 1.0:
        processors.append(TopPLogitsWarper(top_p))
    sampling = {} if greedy else {"temperature": 1.0, "top_p": 1.0, "top_k": 0}
    config = GenerationConfig(do_sample=not greedy, **sampling, max_new_tokens=max_new_tokens, pad_token_id=pad_id,
                              eos_token_id=eos_id, use_cache=True)
    return {"generation_config": config, "logits_processor": LogitsProcessorList(processors)}


@dataclass
class Generation:
    """What :func:`generate` returns, one row per (prompt, sample): row ``i * num_samples + j``.

    Attributes:
        prompt_ids: the rows' input ``[N, W]``, left-padded (``attention_mask`` marks real tokens).
        attention_mask: ``[N, W]``.
        tokens: the generated tokens ``[N, K]``; a row's response is its first ``lengths[i]``
            tokens (up to and including its first eos), padding after.
        lengths: ``[N]`` response lengths.
        log_probs: ``[N, K]`` the model's log-prob of each sampled token (0 after the response),
            or None when not asked for.
    """

    prompt_ids: torch.Tensor
    attention_mask: torch.Tensor
    tokens: torch.Tensor
    lengths: torch.Tensor
    log_probs: Optional[torch.Tensor] = None

    @property
    def response_mask(self) -> torch.Tensor:
        """``[N, K]`` True on each row's response tokens."""
        k = torch.arange(self.tokens.shape[1], device=self.tokens.device)
        return k.unsqueeze(0) < self.lengths.unsqueeze(1)

    def texts(self, tokenizer: Any, pad_id: Optional[int] = None) -> list[str]:
        """The decoded responses (special tokens, eos included, dropped)."""
        pad = tokenizer.pad_token_id if pad_id is None else pad_id
        return tokenizer.batch_decode(torch.where(self.response_mask, self.tokens, pad).tolist(),
                                      skip_special_tokens=True)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt_ids: Sequence[Sequence[int]], *, pad_id: int, eos_id: Optional[int],
             max_new_tokens: int, num_samples: int = 1, greedy: bool = False, temperature: float = 1.0,
             top_p: float = 1.0, seed: Optional[int] = None, log_probs: bool = False) -> Generation:
    """``num_samples`` responses to each prompt in one batched ``generate`` (model in eval mode).

    Args:
        model: a transformers causal LM (or anything with its ``generate``).
        prompt_ids: the prompts' token ids, one list per prompt.

    Keyword Args:
        pad_id, eos_id: the tokenizer's pad and eos ids; a response stops at its first eos.
        max_new_tokens (int): the response budget.
        num_samples (int): responses per prompt.
        greedy (bool): argmax decoding instead of sampling.
        temperature (float), top_p (float): sampling warpers (the log-probs ignore them).
        seed (int): sample under ``torch.manual_seed(seed)`` without touching the global RNG;
            None samples from the global RNG.
        log_probs (bool): record the model's log-prob of each generated token
            (:class:`SampledLogProbs`).
    """
    device = next(model.parameters()).device
    ids, attn = left_pad(prompt_ids, pad_id, repeat=num_samples)
    ids, attn = ids.to(device), attn.to(device)
    recorder = SampledLogProbs() if log_probs else None
    kwargs = generation_kwargs(max_new_tokens=max_new_tokens, pad_id=pad_id, eos_id=eos_id, greedy=greedy,
                               temperature=temperature, top_p=top_p, recorder=recorder)
    was_training = model.training
    model.eval()
    try:
        if seed is None:
            out = generate_left_padded(model, ids, attn, **kwargs)
        else:
            devices = [device.index or 0] if device.type == "cuda" else []
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(seed)
                out = generate_left_padded(model, ids, attn, **kwargs)
    finally:
        model.train(was_training)
    gen = out[:, ids.shape[1]:]
    # each response runs to its first eos (kept: the policy chose to stop), else to the budget
    is_eos = gen == eos_id if eos_id is not None else torch.zeros_like(gen, dtype=torch.bool)
    first = is_eos.to(torch.int8).argmax(-1)
    lengths = torch.where(is_eos.any(-1), first + 1, torch.full_like(first, gen.shape[1]))
    result = Generation(ids, attn, gen, lengths)
    if recorder is not None:
        lp = recorder.finish(gen)
        result.log_probs = torch.where(result.response_mask, lp, lp.new_zeros(()))
    return result


def generate_texts(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    num_samples: int = 1,
    max_new_tokens: int = 8,
    temperature: float = 1.0,
    greedy: bool = False,
    seed: Optional[int] = None,
    batch_size: Optional[int] = None,
) -> list[list[str]]:
    """``num_samples`` decoded responses per prompt: :func:`generate`
    on the prompts' tokens, ``batch_size`` prompts per batch (all in one by default; batch ``k``
    samples with ``seed + k * batch_size``)."""
    pad = pad_token_id(tokenizer)
    step = batch_size or max(len(prompts), 1)
    texts: list[str] = []
    for start in range(0, len(prompts), step):
        ids = [prompt_token_ids(tokenizer, p) for p in prompts[start:start + step]]
        out = generate(model, ids, pad_id=pad, eos_id=tokenizer.eos_token_id, max_new_tokens=max_new_tokens,
                       num_samples=num_samples, greedy=greedy, temperature=temperature,
                       seed=None if seed is None else seed + start)
        texts.extend(out.texts(tokenizer, pad))
    return [texts[i * num_samples : (i + 1) * num_samples] for i in range(len(prompts))]


def greedy_responses(model: Any, tokenizer: Any, prompts: Sequence[str], *, max_new_tokens: int,
                     batch_size: int = 100) -> list[str]:
    """Greedy decoded responses, prompts left-padded in batches of ``batch_size``
    (:func:`generate_texts`): what one prompt at a time would give."""
    return [r[0] for r in generate_texts(model, tokenizer, prompts, greedy=True, max_new_tokens=max_new_tokens,
                                         batch_size=batch_size)]
