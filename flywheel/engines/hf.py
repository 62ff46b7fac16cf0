"""The in-process transformers engine, the CPU default.

Prompts are built with ``chat.encode_chat`` (stored turn ids spliced in, never re-tokenized;
a session's prompt resumes from its previous turn's encoding, ``chat.PromptEncoder``),
sorted by length so each batch pads little, left-padded, and decoded with a small loop over the
model's KV cache. A hand-written loop rather than ``model.generate`` because it gives, in one
place, what the stages need: the log-prob of each chosen id under the raw policy (temperature 1,
no top-p), sampling from a ``torch.Generator`` seeded by ``SamplingParams.seed``, and a clean stop
at the end-of-turn token. Rows that stop leave the batch, so the rest decode a smaller batch.

Multi-turn episodes (``prefix_cache=True``): a chat with a ``session`` keeps the KV cache of its
last turn (its prompt and generated ids) until the next call; when the next prompt starts with
those ids, only the new tokens (the end of the turn, the observation, the next header) go through
the model. The cached rows are placed left-padded in front of the new tokens, so a batch mixes
cached and fresh chats. Sessions missing from a call are forgotten. The result is the one a full
recompute gives, within float rounding (a test compares both ways on multi-turn episodes).

Shared prefill (``share_prefill=True``): rows of one batch with the same prompt ids (and the
same reused session prefix) run through the model once; the representative's KV cache and last
logits are then copied to every row of its group before decoding. MCTS sends ``n_gen`` copies of
a leaf's chat and explore ``K`` copies of a task's opening, so each prompt is computed once, not
``n`` times. Each row still samples on its own, from the same random stream as without sharing:
the result is the one an unshared batch gives, within float rounding (tests compare both ways).

A chat's ``opening`` ids (engines/base.py) join its prompt after the generation prompt; the
returned turn starts with them (log-prob 0.0 each), and the session cache holds them like any
prompt id, so the next turn's prompt (built from the stored opening + generated ids) reuses it.

    engine = HFEngine.from_pretrained("ckpt/")
    gens = engine.generate([Chat(messages)], SamplingParams(temperature=0, max_new_tokens=32))
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from transformers import DynamicCache, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from flywheel.chat import PromptEncoder
from flywheel.engines.base import Chat, Generation, SamplingParams, opened


@dataclass
class _Cached:
    """What one session's last turn left: the ids that went through the model and, per layer,
    their keys and values (each ``[heads, len(ids), head_dim]``)."""

    ids: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]


class _RoomyLayer(DynamicLayer):
    """A key/value cache layer with room reserved up front: each decode step writes its column
    in place instead of ``torch.cat``-ing the whole cache into a new tensor (which copies every
    row's keys and values every step). ``keys``/``values`` are views of the filled part; a
    batch that outgrows the room doubles it."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room, self.filled = room, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        b, h, n, _ = key_states.shape
        room = max(self.room, n)
        self._k = key_states.new_empty((b, h, room, key_states.shape[-1]))
        self._v = value_states.new_empty((b, value_states.shape[1], room, value_states.shape[-1]))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.filled, self.filled + key_states.shape[-2]
        if end > self._k.shape[-2]:
            grow = max(end, 2 * self._k.shape[-2]) - self._k.shape[-2]
            self._k = torch.cat(
                [self._k, self._k.new_empty((*self._k.shape[:2], grow, self._k.shape[-1]))], dim=-2
            )
            self._v = torch.cat(
                [self._v, self._v.new_empty((*self._v.shape[:2], grow, self._v.shape[-1]))], dim=-2
            )
        self._k[:, :, start:end] = key_states
        self._v[:, :, start:end] = value_states
        self.filled = end
        self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
        return self.keys, self.values

    @classmethod
    def holding(cls, keys: torch.Tensor, values: torch.Tensor, filled: int) -> _RoomyLayer:
        """A layer over buffers whose first ``filled`` columns are already written."""
        layer = cls(keys.shape[-2])
        layer.dtype, layer.device, layer.is_initialized = keys.dtype, keys.device, True
        layer._k, layer._v, layer.filled = keys, values, filled
        layer.keys, layer.values = keys[:, :, :filled], values[:, :, :filled]
        return layer

    def get_seq_length(self) -> int:
        return self.filled

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.filled:
            self._k, self._v = self._k[indices], self._v[indices]
            self.keys, self.values = self._k[:, :, : self.filled], self._v[:, :, : self.filled]


def _roomy_cache(room: int) -> DynamicCache:
    """An empty cache whose layers (made as the model asks for them) reserve ``room`` columns."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = lambda: _RoomyLayer(room)  # type: ignore[assignment]
    return cache


def _groups(prompts: list[list[int]], reused: list[int]) -> tuple[list[int], list[int]]:
    """Rows with the same prompt and the same reused prefix length form a group: the first
    row of each group (in row order), and for every row the index of its group among them."""
    index: dict[tuple[int, ...], int] = {}
    firsts: list[int] = []
    group: list[int] = []
    for row, (prompt, r) in enumerate(zip(prompts, reused, strict=True)):
        key = (r, *prompt)
        if key not in index:
            index[key] = len(firsts)
            firsts.append(row)
        group.append(index[key])
    return firsts, group


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class HFEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        batch_size: int = 256,
        device: str = "cpu",
        prefix_cache: bool = True,
        share_prefill: bool = True,
    ) -> None:
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.prefix_cache = prefix_cache
        self.share_prefill = share_prefill
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        # A checkpoint may declare several stop ids (e.g. eos and end-of-turn); stop on any.
        config = getattr(model, "generation_config", None)
        declared = getattr(config, "eos_token_id", None)
        stop = [declared] if isinstance(declared, int) else list(declared or [])
        self.stop_ids = sorted({tokenizer.eos_token_id, *stop} - {None})
        self._sessions: dict[Hashable, _Cached] = {}
        self._encoder = PromptEncoder(tokenizer)  # a session's prompt resumes its last encoding
        # Prompt tokens run through the model and prompt tokens taken from a session's cache
        # (a shared prefill counts once for its whole group).
        self.stats = {"prompt_tokens": 0, "reused_tokens": 0, "generated_tokens": 0}

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype | None = None, **kw
    ) -> HFEngine:
        from flywheel.model import load_policy

        model, tokenizer = load_policy(path, dtype=dtype)
        return cls(model, tokenizer, **kw)

    def close(self) -> None:
        """Forget every session's cache."""
        self._sessions = {}
        self._encoder.keep_only(set())

    def generate(self, chats: list[Chat], params: SamplingParams) -> list[Generation]:
        if params.max_new_tokens < 1:
            empty = Generation(text="", token_ids=[], logprobs=[], finish_reason="length")
            return [opened(empty, c.opening, self.tokenizer) for c in chats]
        # A chat's opening (forced first ids of the turn) is part of its prompt.
        prompts = [
            self._encoder.prompt(c.messages, c.turn_token_ids, c.session) + list(c.opening)
            for c in chats
        ]
        self._encoder.keep_only({c.session for c in chats if c.session is not None})
        cached: list[tuple[_Cached, int] | None] = []
        for chat, prompt in zip(chats, prompts, strict=True):
            hit = self._sessions.get(chat.session) if chat.session is not None else None
            # At least the prompt's last token runs: its logits choose the first new id.
            reuse = min(_common_prefix(hit.ids, prompt), len(prompt) - 1) if hit else 0
            cached.append((hit, reuse) if hit and reuse > 0 else None)
        generator = torch.Generator(self.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        # Similar lengths together: less padding (which changes no result, only the cost).
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        states: list[_Cached | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            gens, kept = self._generate_batch(
                [prompts[i] for i in batch], [cached[i] for i in batch], params, generator
            )
            for i, gen, state in zip(batch, gens, kept, strict=True):
                results[i], states[i] = gen, state
        self._sessions = {
            chat.session: state
            for chat, state in zip(chats, states, strict=True)
            if chat.session is not None and state is not None
        }
        return [
            opened(gen, chat.opening, self.tokenizer)  # type: ignore[arg-type]
            for chat, gen in zip(chats, results, strict=True)
        ]

    @torch.inference_mode()
    def _generate_batch(
        self,
        prompts: list[list[int]],
        cached: list[tuple[_Cached, int] | None],
        params: SamplingParams,
        generator: torch.Generator,
    ) -> tuple[list[Generation], list[_Cached | None]]:
        # Columns: [cached prefix, left-padded to `past`] [new prompt tokens, left-padded to
        # `width`] [generated ids]. Without a cache `past` is 0: plain left padding.
        n = len(prompts)
        reused = [c[1] if c else 0 for c in cached]
        past = max(reused)
        width = max(len(p) - r for p, r in zip(prompts, reused, strict=True))
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, past + width), dtype=torch.long)
        for row, (prompt, r) in enumerate(zip(prompts, reused, strict=True)):
            new = prompt[r:]
            input_ids[row, width - len(new) :] = torch.tensor(new)
            attention[row, past - r : past] = 1
            attention[row, past + width - len(new) :] = 1
        firsts, group = _groups(prompts, reused) if self.share_prefill else (list(range(n)), [])
        self.stats["prompt_tokens"] += sum(len(prompts[i]) - reused[i] for i in firsts)
        self.stats["reused_tokens"] += sum(reused[i] for i in firsts)
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        # Padding shifts the tokens; positions must count real tokens only.
        positions = (attention.cumsum(-1) - 1).clamp(min=0)[:, past:]
        stop_ids = torch.tensor(self.stop_ids, device=self.device)
        room = past + width + params.max_new_tokens  # every column this batch can fill

        # Only the first row of each group of identical prompts runs (all rows without sharing);
        # `width` and `past` stay the whole batch's: each row is padded as in an unshared batch.
        # logits_to_keep=1: the full prompt logits of a large batch would cost gigabytes.
        first_rows = torch.tensor(firsts, device=self.device)
        out = self.model(
            input_ids=input_ids[first_rows],
            attention_mask=attention[first_rows],
            position_ids=positions[first_rows],
            past_key_values=(
                self._past([cached[i] for i in firsts], past, room) if past else _roomy_cache(room)
            ),
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        cache = out.past_key_values
        if len(firsts) < n:
            # Every row gets its own copy of its group's cache and logits, then decodes alone.
            copies = torch.tensor(group, device=self.device)
            cache.batch_select_indices(copies)  # type: ignore[union-attr]
            logits = logits[copies]
        keep_sessions = self.prefix_cache and all(
            type(layer) in (DynamicLayer, _RoomyLayer) for layer in getattr(cache, "layers", [None])
        )
        next_position = positions[:, -1:] + 1

        ids: list[list[int]] = [[] for _ in range(n)]
        lps: list[list[float]] = [[] for _ in range(n)]
        states: list[_Cached | None] = [None] * n
        live = torch.arange(n, device=self.device)  # rows still decoding, in cache order

        def keep(rows: list[int], slots: list[int]) -> None:
            """Copy the cache of finished rows (``slots`` in the pruned cache) out of the batch."""
            for row, slot in zip(rows, slots, strict=True):
                new = len(prompts[row]) - reused[row]
                spans = [(past - reused[row], past), (past + width - new, past + width)]
                spans.append((past + width, past + width + len(ids[row]) - 1))
                kv = []
                for layer in cache.layers:  # type: ignore[union-attr]
                    k, v = layer.keys[slot], layer.values[slot]  # type: ignore[index]
                    kv.append(
                        (
                            torch.cat([k[:, a:b] for a, b in spans], dim=1),
                            torch.cat([v[:, a:b] for a, b in spans], dim=1),
                        )
                    )
                states[row] = _Cached(ids=prompts[row] + ids[row][:-1], kv=kv)

        for step in range(params.max_new_tokens):
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            token = self._choose(logits.float(), params, generator, live, n)
            token_logprobs = logprobs.gather(-1, token[:, None])[:, 0]
            stopped = torch.isin(token, stop_ids)
            rows = live.tolist()
            for row, t, lp in zip(rows, token.tolist(), token_logprobs.tolist(), strict=True):
                ids[row].append(t)
                lps[row].append(lp)
            if stopped.all() or step + 1 == params.max_new_tokens:
                if keep_sessions:
                    keep(rows, list(range(len(rows))))
                break
            if stopped.any():
                # Finished rows leave the batch: the others decode without them.
                slots = stopped.nonzero()[:, 0]
                if keep_sessions:
                    keep([rows[s] for s in slots.tolist()], slots.tolist())
                still = (~stopped).nonzero()[:, 0]
                cache.batch_select_indices(still)  # type: ignore[union-attr]
                live, token = live[still], token[still]
                attention, next_position = attention[still], next_position[still]
            attention = torch.cat([attention, attention.new_ones((len(live), 1))], dim=1)
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=next_position,
                past_key_values=cache,
                use_cache=True,
            )
            logits, cache = out.logits[:, -1, :], out.past_key_values
            next_position = next_position + 1

        stop_set = set(self.stop_ids)
        generations = []
        for row in range(n):
            row_ids, row_lps = ids[row], lps[row]
            self.stats["generated_tokens"] += len(row_ids)
            ended = bool(row_ids) and row_ids[-1] in stop_set
            text_ids = row_ids[:-1] if ended else row_ids
            generations.append(
                Generation(
                    text=cast(str, self.tokenizer.decode(text_ids, skip_special_tokens=False)),
                    token_ids=row_ids,
                    logprobs=row_lps,
                    finish_reason="stop" if ended else "length",
                )
            )
        return generations, states

    def _past(self, cached: list[tuple[_Cached, int] | None], past: int, room: int) -> DynamicCache:
        """The batch's cache of reused prefixes, each row right-aligned in the first ``past`` of
        ``room`` columns."""
        first = next(c[0].kv for c in cached if c)
        cache = _roomy_cache(room)
        for index, (k0, v0) in enumerate(first):
            keys = k0.new_zeros((len(cached), k0.shape[0], room, k0.shape[2]))
            values = v0.new_zeros((len(cached), v0.shape[0], room, v0.shape[2]))
            for row, c in enumerate(cached):
                if c:
                    entry, r = c
                    keys[row, :, past - r : past] = entry.kv[index][0][:, :r]
                    values[row, :, past - r : past] = entry.kv[index][1][:, :r]
            cache.layers.append(_RoomyLayer.holding(keys, values, past))
        return cache

    @staticmethod
    def _choose(
        logits: torch.Tensor,
        params: SamplingParams,
        generator: torch.Generator,
        live: torch.Tensor | None = None,
        rows: int | None = None,
    ) -> torch.Tensor:
        """The next id of each row of ``logits``. When finished rows have left the batch,
        ``live`` names the rows still there among the batch's ``rows``: the draw still covers
        every row, so the random stream, and each row's sample, is the one of a batch that
        kept decoding them all."""
        if params.temperature <= 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            # Nucleus: keep the most likely ids until their mass reaches top_p (always at least one).
            sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, sorted_ids, sorted_probs)
        if live is not None and rows is not None and len(live) < rows:
            full = probs.new_ones((rows, probs.shape[-1]))
            full[live] = probs
            return torch.multinomial(full, 1, generator=generator)[live, 0]
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
