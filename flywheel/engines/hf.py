"""The in-process transformers engine, the CPU default.

Prompts are built with ``chat.encode_chat`` (stored turn ids spliced in, never re-tokenized),
sorted by length so each batch pads little, left-padded, and decoded with a small loop over the
model's KV cache. A hand-written loop rather than ``model.generate`` because it gives, in one
place, what the stages need: the log-prob of each chosen id under the raw policy (temperature 1,
no top-p), sampling from a ``torch.Generator`` seeded by ``SamplingParams.seed``, and a clean stop
at the end-of-turn token.

    engine = HFEngine.from_pretrained("ckpt/")
    gens = engine.generate([Chat(messages)], SamplingParams(temperature=0, max_new_tokens=32))
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

import torch
from transformers import PreTrainedTokenizerBase

from flywheel.chat import encode_chat
from flywheel.engines.base import Chat, Generation, SamplingParams


class HFEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        *,
        batch_size: int = 256,
        device: str = "cpu",
    ) -> None:
        self.model = model.to(device).eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.pad_id = (
            tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        )
        # A checkpoint may declare several stop ids (e.g. eos and end-of-turn); stop on any.
        config = getattr(model, "generation_config", None)
        declared = getattr(config, "eos_token_id", None)
        stop = [declared] if isinstance(declared, int) else list(declared or [])
        self.stop_ids = sorted({tokenizer.eos_token_id, *stop} - {None})

    @classmethod
    def from_pretrained(
        cls, path: str | Path, *, dtype: torch.dtype | None = None, **kw
    ) -> HFEngine:
        from flywheel.model import load_policy

        model, tokenizer = load_policy(path, dtype=dtype)
        return cls(model, tokenizer, **kw)

    def generate(self, chats: list[Chat], params: SamplingParams) -> list[Generation]:
        if params.max_new_tokens < 1:
            return [
                Generation(text="", token_ids=[], logprobs=[], finish_reason="length")
                for _ in chats
            ]
        prompts = [
            encode_chat(self.tokenizer, c.messages, c.turn_token_ids, add_generation_prompt=True)[0]
            for c in chats
        ]
        generator = torch.Generator(self.device)
        if params.seed is None:
            generator.seed()
        else:
            generator.manual_seed(params.seed)
        # Similar lengths together: less padding (which changes no result, only the cost).
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        results: list[Generation | None] = [None] * len(prompts)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            for i, gen in zip(
                batch,
                self._generate_batch([prompts[i] for i in batch], params, generator),
                strict=True,
            ):
                results[i] = gen
        return results  # type: ignore[return-value]

    @torch.inference_mode()
    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, generator: torch.Generator
    ) -> list[Generation]:
        n, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((n, width), dtype=torch.long)
        for row, prompt in enumerate(prompts):
            input_ids[row, width - len(prompt) :] = torch.tensor(prompt)
            attention[row, width - len(prompt) :] = 1
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        # Left padding shifts the prompt; positions must count real tokens only.
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        stop_ids = torch.tensor(self.stop_ids, device=self.device)

        # logits_to_keep=1: the full prompt logits of a large batch would cost gigabytes.
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        past = out.past_key_values
        next_position = positions[:, -1:] + 1

        chosen, chosen_logprobs = [], []
        finished = torch.zeros(n, dtype=torch.bool, device=self.device)
        length = torch.full((n,), params.max_new_tokens, device=self.device)
        for step in range(params.max_new_tokens):
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            token = self._choose(logits.float(), params, generator)
            chosen.append(token)
            chosen_logprobs.append(logprobs.gather(-1, token[:, None])[:, 0])
            stopped = torch.isin(token, stop_ids) & ~finished
            length = torch.where(stopped, step + 1, length)
            finished |= stopped
            if finished.all() or step + 1 == params.max_new_tokens:
                break
            # Rows already stopped keep decoding in lockstep; their extra ids are dropped below.
            attention = torch.cat(
                [attention, torch.ones((n, 1), dtype=attention.dtype, device=self.device)], dim=1
            )
            out = self.model(
                input_ids=token[:, None],
                attention_mask=attention,
                position_ids=next_position,
                past_key_values=past,
                use_cache=True,
            )
            logits, past = out.logits[:, -1, :], out.past_key_values
            next_position = next_position + 1

        ids = torch.stack(chosen, dim=1).tolist()
        lps = torch.stack(chosen_logprobs, dim=1).tolist()
        stop_set = set(self.stop_ids)
        generations = []
        for row in range(n):
            k = int(length[row])
            row_ids, row_lps = ids[row][:k], lps[row][:k]
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
        return generations

    @staticmethod
    def _choose(
        logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
    ) -> torch.Tensor:
        if params.temperature <= 0:
            return logits.argmax(dim=-1)
        probs = torch.softmax(logits / params.temperature, dim=-1)
        if params.top_p < 1.0:
            # Nucleus: keep the most likely ids until their mass reaches top_p (always at least one).
            sorted_probs, sorted_ids = probs.sort(dim=-1, descending=True)
            outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= params.top_p
            sorted_probs = sorted_probs.masked_fill(outside, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, sorted_ids, sorted_probs)
        return torch.multinomial(probs, 1, generator=generator)[:, 0]
