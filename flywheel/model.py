"""The embedded default policy: a word-level tokenizer trained on the environments' text and a
tiny randomly initialised Llama model, both plain transformers objects.

Tokenization decides whether the CPU demo learns: with numbers as single tokens (groups of at
most three digits) and tags and words as single tokens, a ~1M-parameter model learns a one-tool-call
arithmetic task in a few hundred steps; with character-level tokens it barely does. So the
tokenizer isolates tags (``<python>``), digit groups, words and every other single character, and
decodes losslessly by concatenating the pieces.

Used at bootstrap::

    tok = train_tokenizer(texts)              # texts: instructions, tasks, expert turns...
    model = build_tiny_model(tok, seed=0)
    save_policy(model, tok, "ckpt/")          # a normal HF folder
    model, tok = load_policy("ckpt/")         # AutoTokenizer / AutoModelForCausalLM, offline
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

if TYPE_CHECKING:
    from flywheel.config import TinyModelConfig

PAD, UNK, END = "<|pad|>", "<|unk|>", "<|end|>"
SPECIAL_TOKENS = [PAD, UNK, "<|user|>", "<|assistant|>", "<|system|>", END]

# Leftmost alternative wins, so a tag beats its characters and a digit group beats a digit.
# A word takes the space before it (" has"): half the tokens of a sentence, same lossless decode.
# [0-9] rather than \d: the regex engine's \d also matches non-ASCII digits.
PIECE_PATTERN = r"</?[a-z_]+>|[0-9]{1,3}| ?[A-Za-z_]+|[\s\S]"


def piece_pattern(number_digits: int = 3) -> str:
    """PIECE_PATTERN with numbers cut into groups of at most ``number_digits`` digits."""
    if not 1 <= number_digits <= 3:
        raise ValueError(f"number_digits must be 1, 2 or 3, got {number_digits}")
    return PIECE_PATTERN.replace("{1,3}", f"{{1,{number_digits}}}")


# Every message is `<|role|>content<|end|>\n`; the generation prompt is `<|assistant|>`, so the
# model's turn ends with the eos token and the engine can stop on it.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _base_vocabulary(number_digits: int = 3) -> list[str]:
    """Pieces every tokenizer knows whatever the corpus: special tokens, printable ASCII and all
    digit groups up to ``number_digits`` wide (with leading zeros, so that any number
    round-trips)."""
    pieces = list(SPECIAL_TOKENS)
    pieces += [chr(i) for i in range(32, 127)] + ["\n", "\t", "\r"]
    for width in range(1, number_digits + 1):
        pieces += [str(i).zfill(width) for i in range(10**width)]
    return list(dict.fromkeys(pieces))  # drops the single digits seen twice, keeps order


def train_tokenizer(
    texts: Iterable[str], *, min_frequency: int = 1, number_digits: int = 3
) -> PreTrainedTokenizerFast:
    """A word-level tokenizer whose vocabulary is the base pieces plus every piece of ``texts``
    seen at least ``min_frequency`` times, numbers cut into groups of at most ``number_digits``
    digits. Deterministic: same texts, same ids."""
    pattern = piece_pattern(number_digits)
    pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(piece for piece, _ in pre_tokenizer.pre_tokenize_str(text))
    # A word seen mid-sentence (" has") may open a message ("has"), and the other way round:
    # both forms join the vocabulary so neither becomes <|unk|>.
    # A word counts once per use, whichever form it took.
    words: Counter[str] = Counter()
    for piece, n in counts.items():
        if piece.lstrip(" ").isidentifier() and len(piece) - len(piece.lstrip(" ")) <= 1:
            words[piece.lstrip(" ")] += n
    for word, n in words.items():
        counts[word] = counts[" " + word] = n

    pieces = _base_vocabulary(number_digits)
    known = set(pieces)
    # Most frequent first, ties by text, so the ids do not depend on the order of the corpus.
    extra = sorted(
        (p for p, n in counts.items() if n >= min_frequency and p not in known),
        key=lambda p: (-counts[p], p),
    )
    vocab = {piece: i for i, piece in enumerate(pieces + extra)}

    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    backend.pre_tokenizer = pre_tokenizer
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD,
        unk_token=UNK,
        eos_token=END,
        chat_template=CHAT_TEMPLATE,
        # The default clean-up would glue " ." into "." and break lossless decoding.
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )


def build_tiny_model(
    tokenizer: PreTrainedTokenizerBase,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 384,
    max_position_embeddings: int = 1024,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised Llama with tied embeddings sized to ``tokenizer``; the same seed
    gives the same weights without touching the global RNG."""
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = None
    return model


def build_tiny_policy(
    texts: Iterable[str], tiny: TinyModelConfig, seed: int
) -> tuple[PreTrainedTokenizerBase, LlamaForCausalLM]:
    """The embedded policy as ``model.tiny`` describes it: a tokenizer trained on ``texts`` and
    a random-init model sized to it. The init stage and the benchmarks both build it here."""
    tokenizer = train_tokenizer(texts, number_digits=tiny.number_digits)
    model = build_tiny_model(
        tokenizer,
        hidden_size=tiny.hidden_size,
        num_layers=tiny.num_layers,
        num_heads=tiny.num_heads,
        intermediate_size=tiny.intermediate_size,
        max_position_embeddings=tiny.max_position_embeddings,
        seed=seed,
    )
    return tokenizer, model


def save_policy(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, path: str | Path
) -> Path:
    """Write a Hugging Face folder that transformers (and vLLM) load as it is."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def load_policy(
    path: str | Path, *, device: str = "cpu", dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a policy folder (ours or any local HF checkpoint); never reaches a hub."""
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, **kwargs)
    model.to(device)  # type: ignore[arg-type]  # transformers wraps .to() with a mistyped decorator
    return model, tokenizer
