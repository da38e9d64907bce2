"""Causal language models as TensorDict modules: per-token log-probs and scalar rewards.

:class:`CausalLMLogProbs` wraps any causal LM (a transformers ``*ForCausalLM``, or any
module mapping token ids to logits) and writes the log-probability of every token
given the tokens before it, in one forward over all rows of the batch: a
preference batch ``[B, 2]`` runs as ``B*2`` rows.

Why not TorchRL's ``TransformersWrapper``: in log-prob mode it re-tokenises text or
takes ragged token lists, keeps the full-vocabulary log-softmax, and returns ragged
``LogProbs``; a preference step already holds padded ``[B, 2, T]`` tokens and only needs
the gathered log-prob of each token. Reading those tokens directly and gathering
``logit - logsumexp(logits)`` avoids both the re-tokenisation and a ``[N, T, V]``
log-softmax copy. We still use ``TransformersWrapper`` where TorchRL's own losses need
it (GRPO); see :mod:`offline_plugins.text.envs.text`.

Token layout (TorchRL's LLM keys): ``("tokens", "full")`` holds prompt + response,
right-padded; ``("masks", "all_attention_mask")`` marks real tokens and
``("masks", "all_assistant_mask")`` marks response tokens. ``("log_probs", "full")``
has the same shape; entry ``t`` is ``log p(token_t | tokens_<t)``, 0 at ``t = 0`` and
on padding.

>>> import torch
>>> from tensordict import TensorDict
>>> lm = torch.nn.Embedding(7, 7)  # any module mapping ids [N, T] to logits [N, T, V]
>>> actor = CausalLMLogProbs(lm)
>>> td = TensorDict({"tokens": {"full": torch.randint(0, 7, (3, 2, 5))},
...                  "masks": {"all_attention_mask": torch.ones(3, 2, 5, dtype=torch.bool)}}, [3, 2])
>>> actor(td)["log_probs", "full"].shape
torch.Size([3, 2, 5])
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Optional

import torch
from tensordict import NestedKey, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from torch.utils.checkpoint import checkpoint
from transformers.utils import logging as hf_logging

__all__ = ["CausalLMLogProbs", "CausalLMReward", "AdaptersOff", "token_log_probs", "chunked_token_log_probs",
           "shared_prefix_log_probs",
           "sequence_log_probs", "aggregate_rewards", "ENSEMBLE_AGGREGATES", "forward_memory_bytes"]


def _is_hf_like(model: torch.nn.Module) -> bool:
    """Whether ``model`` takes ``input_ids=`` and ``attention_mask=`` keywords (transformers models do)."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
    return "input_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class _RightPaddingIsMasked:
    """A logging filter for transformers' "passing an attention_mask" warning on right-padded rows.

    Right-padded rows are scored without a mask on purpose (causal attention never lets a
    real token see the padding after it, and the maskless path is the faster one), so the
    warning transformers gives when it sees pad tokens and no mask says nothing true here.
    It is dropped only while such a forward runs."""

    def filter(self, record) -> bool:
        return "attention_mask" not in record.getMessage()


def _logits_of(model: torch.nn.Module, hf_like: bool, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
    if not hf_like:
        out = model(input_ids)
    elif attention_mask is None:
        logger, quiet = hf_logging.get_logger("transformers.modeling_utils"), _RightPaddingIsMasked()
        logger.addFilter(quiet)
        try:
            out = model(input_ids=input_ids)
        finally:
            logger.removeFilter(quiet)
    else:
        out = model(input_ids=input_ids, attention_mask=attention_mask)
    return out if isinstance(out, torch.Tensor) else out.logits


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """``log p(tokens[:, t] | tokens[:, :t])`` from ``logits [N, T, V]``; 0 at ``t = 0`` and on padding.

    Computed in fp32 as ``logit - logsumexp`` so a bf16 model's log-probs are not
    rounded to bf16 (the seeds' 1e-2 precision trap).
    """
    logits = logits[:, :-1].float()
    target = tokens[:, 1:].unsqueeze(-1)
    lp = logits.gather(-1, target).squeeze(-1) - logits.logsumexp(-1)
    lp = torch.nn.functional.pad(lp, (1, 0))
    return torch.where(attention_mask.bool(), lp, lp.new_zeros(()))


def shared_prefix_log_probs(model: torch.nn.Module, tokens: torch.Tensor, attention_mask: torch.Tensor,
                            response_mask: torch.Tensor) -> Optional[torch.Tensor]:
    """:func:`token_log_probs` of right-padded rows ``[N, T]``, each prompt forwarded once.

    A row's prompt is everything before its first response token (``response_mask``); rows
    with the same prompt (a GRPO group's ``G`` responses, a DPO pair's chosen and rejected)
    share one forward of it: the distinct prompts run once (right-padded, ``use_cache=True``),
    their key/value cache is copied to each of their rows, and the rows' continuations (the
    response onwards, moved to start at column 0) run on it with their own positions
    (``prompt length + j``) and an attention mask that hides the cache's padding. Gradients
    reach the prompt's forward through the cache, summed over the rows that share it.

    Returns None when no two rows share a prompt (nothing to save: the caller runs the one
    forward). The distinct prompts are found on the data (``torch.unique``): a host sync per
    call, where the unshared path has none.
    """
    n, width = tokens.shape
    device = tokens.device
    resp = response_mask.bool() & attention_mask.bool()
    has = resp.any(-1)
    start = torch.where(has, resp.to(torch.int8).argmax(-1), attention_mask.long().sum(-1))  # prompt lengths
    cols = torch.arange(width, device=device)
    in_prompt = cols.unsqueeze(0) < start.unsqueeze(1)
    keys = torch.cat([start.unsqueeze(1), torch.where(in_prompt, tokens, torch.full_like(tokens, -1))], 1)
    uniq, inverse = torch.unique(keys, dim=0, return_inverse=True)
    u = uniq.shape[0]
    if u == n or bool((start < 1).any()):
        return None
    plen = uniq[:, 0]
    pwidth = int(plen.max())
    p_ids = uniq[:, 1:pwidth + 1].clamp_min(0)
    p_mask = torch.arange(pwidth, device=device).unsqueeze(0) < plen.unsqueeze(1)
    out = model(input_ids=p_ids, attention_mask=p_mask.long(), use_cache=True)
    # transformers >= 5.2x names the cache ``cache``; earlier versions ``past_key_values``
    named = "cache" if getattr(out, "cache", None) is not None else "past_key_values"
    p_logits, cache = out.logits, getattr(out, named)
    lengths = attention_mask.long().sum(-1)
    cwidth = int((lengths - start).max())
    j = torch.arange(cwidth, device=device).unsqueeze(0)
    src = (start.unsqueeze(1) + j).clamp_max(width - 1)
    c_mask = j < (lengths - start).unsqueeze(1)
    c_ids = torch.where(c_mask, tokens.gather(1, src), torch.zeros_like(src))
    cache.batch_select_indices(inverse)  # each row gets its prompt's keys and values
    full_mask = torch.cat([p_mask[inverse], c_mask], 1).long()
    positions = start.unsqueeze(1) + j
    c_logits = model(input_ids=c_ids, attention_mask=full_mask, position_ids=positions, use_cache=False,
                     **{named: cache}).logits
    # log p(token t): t < start from the prompt's logits at t-1; t = start from the prompt's last;
    # t > start from the continuation's logits at t-1-start
    p_lp = token_log_probs(p_logits, p_ids, p_mask)  # [U, pwidth], 0 at t = 0
    last = p_logits[inverse, start - 1].float()  # [N, V]
    first = last.gather(-1, tokens.gather(1, start.clamp_max(width - 1).unsqueeze(1))).squeeze(-1) - last.logsumexp(-1)
    c_lp = token_log_probs(c_logits, c_ids, c_mask)  # [N, cwidth]: 0 at j = 0 (the first token, from the prompt)
    t = cols.unsqueeze(0).expand(n, width)
    from_prompt = p_lp[inverse].gather(1, t.clamp_max(pwidth - 1))
    from_cont = c_lp.gather(1, (t - start.unsqueeze(1)).clamp(0, cwidth - 1))
    lp = torch.where(t < start.unsqueeze(1), from_prompt,
                     torch.where(t == start.unsqueeze(1), first.unsqueeze(1), from_cont))
    return torch.where(attention_mask.bool(), lp, lp.new_zeros(()))


def _chunk_log_probs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def chunked_token_log_probs(head: torch.nn.Module, hidden: torch.Tensor, tokens: torch.Tensor,
                            attention_mask: torch.Tensor, *, chunk_size: int) -> torch.Tensor:
    """:func:`token_log_probs` from the last hidden states ``[N, T, H]`` and the output layer
    ``head``, ``chunk_size`` positions at a time: the ``[N, T, V]`` logits are never held at once.

    Each chunk's logits are recomputed in the backward pass (``torch.utils.checkpoint``), so
    training holds ``[N, chunk_size, V]`` logits at the most, not ``[N, T, V]``: with a
    vocabulary of 32k-150k those dominate a small model's memory. The values are those of the
    unchunked path up to float rounding.
    """
    targets = tokens[:, 1:]
    states = hidden[:, :-1]
    parts = []
    for start in range(0, targets.shape[1], chunk_size):
        h, y = states[:, start:start + chunk_size], targets[:, start:start + chunk_size]
        if torch.is_grad_enabled() and h.requires_grad:
            parts.append(checkpoint(_chunk_log_probs, head, h, y, use_reentrant=False))
        else:
            parts.append(_chunk_log_probs(head, h, y))
    lp = torch.nn.functional.pad(torch.cat(parts, 1), (1, 0))
    return torch.where(attention_mask.bool(), lp, lp.new_zeros(()))


def _split_head(model: torch.nn.Module) -> Optional[tuple[torch.nn.Module, torch.nn.Module]]:
    """``(base, head)`` of a transformers causal LM whose logits are ``head(base(ids).last_hidden_state)``,
    or None where that does not hold (no output layer, a final softcap or scale on the logits)."""
    if callable(getattr(model, "get_base_model", None)):  # peft: the adapted transformers model itself
        model = model.get_base_model()
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    base = getattr(model, "base_model", None)
    config = getattr(model, "config", None)
    if head is None or base is None or base is model or config is None:
        return None
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return None
    return base, head


def _config_sizes(model: torch.nn.Module) -> tuple[int, int, int, int]:
    """``(vocab, hidden, layers, heads)`` of a transformers config (GPT-2's or Llama's names), or
    what the module's own parameters say when it has no config."""
    config = getattr(model, "config", None)
    get = lambda *names: next((int(getattr(config, n)) for n in names if getattr(config, n, None)), 0)  # noqa: E731
    emb = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    if emb is None:  # the first matrix stands for the embedding
        emb = next((p for p in model.parameters() if p.dim() == 2), torch.zeros(1, 1))
    vocab = get("vocab_size") or int(emb.shape[0])
    hidden = get("hidden_size", "n_embd", "d_model") or int(emb.shape[1])
    return vocab, hidden, get("num_hidden_layers", "n_layer", "num_layers") or 1, get("num_attention_heads", "n_head") or 1


def forward_memory_bytes(model: torch.nn.Module, rows: int, length: int, *, backward: bool = True,
                         logprob_chunk: int = 0, optimizer: bool = True) -> int:
    """A rough upper estimate of the memory one forward (and backward) of ``rows`` sequences of
    ``length`` tokens takes, in bytes, float32: the logits (``[rows, length, vocab]``, with their
    log-softmax and gradient; per chunk of ``logprob_chunk`` positions when set), the activations
    a backward keeps (Korthikanti et al. 2022's per-layer count, doubled for float32), and with
    ``optimizer`` the trained copy's weights, gradients and Adam moments (16 bytes a parameter).
    It is what a run checks before it starts, to refuse a batch that cannot fit with one line
    instead of meeting the out-of-memory killer.

    >>> lm = torch.nn.Embedding(100, 100)  # no config: vocab = hidden = 100, one layer, one head
    >>> forward_memory_bytes(lm, 8, 16, backward=False, optimizer=False)  # logits 102400 + layer 204800 + scores 8192
    315392
    """
    vocab, hidden, layers, heads = _config_sizes(model)
    positions = min(length, logprob_chunk) if logprob_chunk else length
    logits = rows * positions * vocab * 4 * (3 if backward else 2)
    if backward:  # per layer: 34 bytes per hidden unit and 5 per attention score in fp16 (Korthikanti et al.)
        acts = layers * rows * length * (68 * hidden + 10 * heads * length)
    else:  # what one layer holds at a time
        acts = rows * length * hidden * 4 * 4 + rows * heads * length * length * 4
    params = sum(p.numel() for p in model.parameters()) * 16 if optimizer else 0
    return int(logits + acts + params)


def sequence_log_probs(log_probs: torch.Tensor, response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum, count)`` of per-token log-probs over the response tokens (last dim)."""
    mask = response_mask.to(log_probs.dtype)
    return (log_probs * mask).sum(-1), mask.sum(-1)


class CausalLMLogProbs(TensorDictModuleBase):
    """Per-token log-probs of a causal LM, for any number of leading batch dims.

    Args:
        model: a transformers causal LM, or any module mapping ``input_ids [N, T]`` to
            logits ``[N, T, V]`` (or to an output with ``.logits``).

    Keyword Args:
        tokens_key: token ids, prompt + response, right-padded. Defaults to ``("tokens", "full")``.
        attention_mask_key: real (non-pad) tokens. Defaults to ``("masks", "all_attention_mask")``.
        log_probs_key: where the log-probs go. Defaults to ``("log_probs", "full")``.
        right_padded (bool): rows are right-padded (the layout of this package). The model
            then runs without the attention mask: under causal attention a real token only
            sees earlier positions, all real, so its log-prob is unchanged, and building the
            padding mask costs ~15% of a tiny model's step. Set ``False`` for left padding.
            Defaults to ``True``.
        chunk_size (int, optional): compute the log-probs ``chunk_size`` positions at a time
            from the model's last hidden states and output layer, so the ``[N, T, V]`` float32
            logits are never materialised (:func:`chunked_token_log_probs`; for large
            vocabularies, measured in ``bench/logprob_memory_bench.py``). Needs a transformers
            causal LM whose logits are its output layer applied to the base model's last hidden
            state; any other model raises. Defaults to ``None`` (one forward to full logits).
        shared_prefix (bool): rows that share a prompt (a GRPO group, a DPO pair) forward it once
            and continue from its key/value cache (:func:`shared_prefix_log_probs`; the same
            log-probs and gradients up to float rounding). Reads the response mask
            (``response_mask_key`` in ``forward``; the ``response_mask`` argument of
            :meth:`log_probs`) to find where each prompt ends; right-padded transformers models
            only, not with ``chunk_size``. Defaults to ``False``.
        response_mask_key: the response-token mask ``shared_prefix`` reads. Defaults to
            ``("masks", "all_assistant_mask")``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tokens_key: NestedKey = ("tokens", "full"),
        attention_mask_key: NestedKey = ("masks", "all_attention_mask"),
        log_probs_key: NestedKey = ("log_probs", "full"),
        right_padded: bool = True,
        chunk_size: Optional[int] = None,
        shared_prefix: bool = False,
        response_mask_key: NestedKey = ("masks", "all_assistant_mask"),
    ) -> None:
        super().__init__()
        self.model = model
        self.right_padded = right_padded
        if shared_prefix and (chunk_size is not None or not right_padded or not _is_hf_like(model)):
            raise ValueError("CausalLMLogProbs: shared_prefix needs a right-padded transformers causal LM and no "
                             "chunk_size (each chunk would need the continuation's hidden states)")
        self.shared_prefix = bool(shared_prefix)
        self.response_mask_key = response_mask_key
        if chunk_size is not None:
            if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
                raise ValueError(f"CausalLMLogProbs: chunk_size must be a whole number >= 1 or None, got {chunk_size!r}")
            if _split_head(model) is None:
                raise ValueError(f"CausalLMLogProbs: chunk_size needs a transformers causal LM whose logits are its "
                                 f"output layer on the base model's last hidden state; {type(model).__name__} is not "
                                 "one (or scales or caps its logits): leave chunk_size=None")
        self.chunk_size = chunk_size
        self._hf_like = _is_hf_like(model)
        self.tokens_key = tokens_key
        self.attention_mask_key = attention_mask_key
        self.log_probs_key = log_probs_key
        self.in_keys = [tokens_key, attention_mask_key]
        self.out_keys = [log_probs_key]

    @property
    def vocab_size(self) -> Optional[int]:
        config = getattr(self.model, "config", None)
        if config is not None and getattr(config, "vocab_size", None) is not None:
            return int(config.vocab_size)
        return getattr(self.model, "num_embeddings", None)

    def log_probs(self, tokens: torch.Tensor, attention_mask: torch.Tensor,
                  response_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Log-probs for ``tokens [..., T]``; all leading dims run as one batch of rows (with
        ``shared_prefix`` and a ``response_mask``, rows sharing a prompt forward it once)."""
        lead = tokens.shape[:-1]
        ids = tokens.reshape(-1, tokens.shape[-1])
        mask = attention_mask.reshape(ids.shape)
        if self.shared_prefix and response_mask is not None:
            lp = shared_prefix_log_probs(self.model, ids, mask, response_mask.reshape(ids.shape))
            if lp is not None:
                return lp.reshape(*lead, ids.shape[-1])
        if self.chunk_size is not None:
            base, head = _split_head(self.model)  # checked when the module was made
            hidden = base(input_ids=ids, attention_mask=None if self.right_padded else mask.long()).last_hidden_state
            lp = chunked_token_log_probs(head, hidden, ids, mask, chunk_size=self.chunk_size)
            return lp.reshape(*lead, ids.shape[-1])
        logits = _logits_of(self.model, self._hf_like, ids, None if self.right_padded else mask.long())
        return token_log_probs(logits, ids, mask).reshape(*lead, ids.shape[-1])

    def logits(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The model's full-vocabulary logits ``[..., T, V]`` for ``tokens [..., T]`` (what the
        distillation losses compare; one forward, whatever ``chunk_size`` and ``shared_prefix`` say)."""
        ids = tokens.reshape(-1, tokens.shape[-1])
        mask = attention_mask.reshape(ids.shape)
        out = _logits_of(self.model, self._hf_like, ids, None if self.right_padded else mask.long())
        return out.reshape(*tokens.shape, out.shape[-1])

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        tokens = tensordict.get(self.tokens_key)
        mask = tensordict.get(self.attention_mask_key)
        response = tensordict.get(self.response_mask_key, None) if self.shared_prefix else None
        tensordict.set(self.log_probs_key, self.log_probs(tokens, mask, response))
        return tensordict


#: how an ensemble's rewards become one: the mean, the min, or the mean minus k std ("lcb")
ENSEMBLE_AGGREGATES = ("mean", "min", "lcb")
def aggregate_rewards(heads: torch.Tensor, aggregate: str = "mean", *, k: float = 1.0) -> torch.Tensor:
    """One reward from an ensemble's ``[..., K]`` rewards: ``mean``, ``min``, or ``lcb`` = mean - k * std.

    The std is the population std over the K members (0 for one member). ``min`` and
    ``lcb`` penalise what the members disagree on: the uncertainty-penalised reward of
    reward-model ensembles against over-optimisation (Coste et al. 2023, arXiv:2310.02743;
    Eisenstein et al. 2023, arXiv:2312.09244).

    >>> r = torch.tensor([[1.0, 3.0], [2.0, 2.0]])
    >>> aggregate_rewards(r, "mean").tolist(), aggregate_rewards(r, "min").tolist()
    ([2.0, 2.0], [1.0, 2.0])
    >>> aggregate_rewards(r, "lcb", k=1.0).tolist()
    [1.0, 2.0]
    """
    if aggregate == "mean":
        return heads.mean(-1)
    if aggregate == "min":
        return heads.amin(-1)
    if aggregate == "lcb":
        return heads.mean(-1) - k * heads.std(-1, correction=0)
    raise ValueError(f"aggregate must be one of {', '.join(ENSEMBLE_AGGREGATES)}, got {aggregate!r}")


class CausalLMReward(TensorDictModuleBase):
    """A scalar reward per sequence: a causal LM's last hidden state at the last real token, then a linear head.

    The reward model of RLHF (Ouyang et al. 2022, arXiv:2203.02155) built on the same
    backbone as the policy. Rows are right-padded; the last real token is found from
    the attention mask.

    Args:
        model: a transformers causal LM (its ``config.hidden_size`` sizes the head; it must
            accept ``output_hidden_states=True``).

    Keyword Args:
        tokens_key, attention_mask_key: as :class:`CausalLMLogProbs`.
        reward_key: where the reward goes, shape ``[...]``. Defaults to ``"reward"``.
        heads: an ensemble of this many linear heads on the shared backbone (each
            initialised apart; :class:`~offline_plugins.objectives.llm.BradleyTerryLoss`
            trains each on its own bootstrap of the pairs). Defaults to 1.
        aggregate: how the heads' rewards become the reward: ``"mean"``, ``"min"`` or
            ``"lcb"`` (mean minus ``uncertainty_coef`` std). Defaults to ``"mean"``.
        uncertainty_coef: ``k`` of ``"lcb"``. Defaults to 1.0.
        heads_key: where ``forward`` writes every head's reward ``[..., heads]`` when
            ``heads > 1``. Defaults to ``"reward_heads"``.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tokens_key: NestedKey = ("tokens", "full"),
        attention_mask_key: NestedKey = ("masks", "all_attention_mask"),
        reward_key: NestedKey = "reward",
        heads: int = 1,
        aggregate: str = "mean",
        uncertainty_coef: float = 1.0,
        heads_key: NestedKey = "reward_heads",
    ) -> None:
        super().__init__()
        if int(heads) < 1:
            raise ValueError(f"heads must be at least 1, got {heads}")
        if aggregate not in ENSEMBLE_AGGREGATES:
            raise ValueError(f"aggregate must be one of {', '.join(ENSEMBLE_AGGREGATES)}, got {aggregate!r}")
        self.model = model
        self.num_heads = int(heads)
        self.aggregate = aggregate
        self.uncertainty_coef = float(uncertainty_coef)
        self.head = torch.nn.Linear(model.config.hidden_size, self.num_heads)
        torch.nn.init.zeros_(self.head.bias)
        self.tokens_key = tokens_key
        self.attention_mask_key = attention_mask_key
        self.reward_key = reward_key
        self.heads_key = heads_key
        self.in_keys = [tokens_key, attention_mask_key]
        self.out_keys = [reward_key] + ([heads_key] if self.num_heads > 1 else [])

    def head_rewards(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Every head's reward, ``[..., heads]``."""
        lead = tokens.shape[:-1]
        ids = tokens.reshape(-1, tokens.shape[-1])
        mask = attention_mask.reshape(ids.shape).long()
        hidden = self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-1]
        last = (mask.sum(-1) - 1).clamp_min(0)
        h = hidden[torch.arange(ids.shape[0], device=ids.device), last]
        return self.head(h.float()).reshape(*lead, self.num_heads)

    def combine(self, heads: torch.Tensor) -> torch.Tensor:
        """The reward from ``[..., heads]`` head rewards, by ``aggregate``."""
        if self.num_heads == 1:
            return heads.squeeze(-1)
        return aggregate_rewards(heads, self.aggregate, k=self.uncertainty_coef)

    def rewards(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The (aggregated) reward per sequence, ``[...]``: what RL and evaluation read."""
        return self.combine(self.head_rewards(tokens, attention_mask))

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        heads = self.head_rewards(tensordict.get(self.tokens_key), tensordict.get(self.attention_mask_key))
        tensordict.set(self.reward_key, self.combine(heads))
        if self.num_heads > 1:
            tensordict.set(self.heads_key, heads)
        return tensordict


class AdaptersOff(torch.nn.Module):
    """A peft model seen with its adapters switched off and in eval mode: the frozen reference of a LoRA run.

    DPO-style losses compare the policy with its reference; with LoRA the reference is
    the base model the adapters sit on, so one set of weights serves both
    (``disable_adapter()`` for each reference forward). It registers no submodule, so
    switching it to train or eval mode leaves the policy alone, and it moves with the
    policy. ``generate`` and ``config`` are the base model's.

    Args:
        peft_model: a ``peft.PeftModel`` (``get_peft_model(base, LoraConfig(...))``).
    """

    def __init__(self, peft_model: torch.nn.Module) -> None:
        super().__init__()
        self.__dict__["peft_model"] = peft_model  # not a submodule: the policy owns these weights

    def _off(self):
        @contextlib.contextmanager
        def off():
            was = self.peft_model.training
            self.peft_model.eval()
            try:
                with self.peft_model.disable_adapter():
                    yield
            finally:
                self.peft_model.train(was)

        return off()

    def forward(self, *args, **kwargs):
        with self._off():
            return self.peft_model(*args, **kwargs)

    def generate(self, *args, **kwargs):
        with self._off():
            return self.peft_model.generate(*args, **kwargs)

    def parameters(self, recurse: bool = True):
        return self.peft_model.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.peft_model.named_parameters(*args, **kwargs)

    @property
    def config(self):
        return self.peft_model.config

    def to(self, *args, **kwargs):  # the weights are the policy's; they move with it
        return self
