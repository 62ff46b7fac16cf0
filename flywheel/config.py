"""Typed configuration: YAML files plus ``key.sub=value`` overrides, validated by pydantic.

Every section is a model that refuses unknown keys, and every field carries help text
(``flywheel config --fields`` prints them). A stage reads only its own section, and the
artifact id of a stage hashes exactly what its ``artifact_config(cfg, round)`` (next to its
``run``) returns, so changing DPO's beta reruns dpo and what follows, nothing before it.

``TrainSection`` is the one training config: the sft, dpo, grpo, sft_more and rft sections are
its subclasses and the training loop takes it as it is.

    cfg = load_config("configs/default.yaml", ["sft.lr=1e-3", "run.rounds=1"])
"""

from __future__ import annotations

import re
from pathlib import Path
from types import UnionType
from typing import Any, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo


class ConfigError(ValueError):
    """A config file or override is wrong; the message is one line naming the key."""


_PLAIN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}")


class DuplicateKeyError(yaml.MarkedYAMLError):
    """A mapping repeats a key; plain YAML keeps the last one silently."""


class _UniqueKeyLoader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<: *anchor' merges; keys after it override by design
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise DuplicateKeyError(
                        problem=f"duplicate key {key!r}", problem_mark=key_node.start_mark
                    )
                seen.add(key)
            except TypeError:  # an unhashable key: the base class says so
                pass
        return super().construct_mapping(node, deep=deep)


def _load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)


class Section(BaseModel):
    # inf and nan are refused for every float (a temperature of inf samples uniformly)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunConfig(Section):
    name: str = Field(
        default="default",
        description="Run name: the folder under the store and the MLflow run name.",
    )
    work_dir: str = Field(
        default="work",
        description="Folder for the store, the MLflow database and logs (relative to the current directory).",
    )
    store: str | None = Field(
        default=None,
        description="Artifact store root: a local path or any fsspec URL (s3://, gs://, memory://). Default: <work_dir>/store.",
    )
    seed: int = Field(
        default=0,
        description="Seed for task generation and sampling, and for model init and data order unless train_seed is set.",
    )
    train_seed: int | None = Field(
        default=None,
        description="Seed for model init, data order and the training stages' draws, apart from the tasks and exploration (null: seed). Retrains the same tasks with a different random draw.",
    )
    rounds: int = Field(
        default=2,
        ge=0,
        description="Flywheel rounds after the bootstrap (round 0 = tasks, expert, sft).",
    )
    log_every: int = Field(
        default=0,
        ge=0,
        description="Print a progress line every this many training steps (0: about 20 lines per run).",
    )

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        # the name is a folder under the store: '../x' or 'a/b' would write outside it
        if not _PLAIN_NAME.fullmatch(name) or ".." in name:
            raise ValueError(
                f"must be a plain name (letters, digits, '_', '-', '.'; no '/' or '..'), got {name!r}"
            )
        return name

    @field_validator("work_dir", "store")
    @classmethod
    def _not_empty(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must not be empty")
        return value

    def store_root(self) -> str:
        return self.store or str(Path(self.work_dir) / "store")


class TinyModelConfig(Section):
    hidden_size: int = Field(
        default=128, ge=1, description="Width of the embedded Llama-architecture policy."
    )
    num_layers: int = Field(
        default=4, ge=1, description="Transformer layers of the embedded policy."
    )
    num_heads: int = Field(default=4, ge=1, description="Attention heads of the embedded policy.")
    intermediate_size: int = Field(
        default=384, ge=1, description="MLP width of the embedded policy."
    )
    max_position_embeddings: int = Field(
        default=1024, ge=8, description="Longest sequence the embedded policy accepts."
    )
    number_digits: int = Field(
        default=3,
        ge=1,
        le=3,
        description="Digits per number piece of the embedded tokenizer: 3 = every number below 1000 is one token (as GPT-4's and Llama 3's tokenizers chunk numbers), 1 = one token per digit (as Qwen2.5's and Llama 2's). With 3, a number that appears in no demonstration is a token the policy has never written, and the tasks that need it stay unsolved by any learning from its own successes (docs/results.md, 'How far imitation goes').",
    )

    @model_validator(mode="after")
    def _head_dim(self) -> TinyModelConfig:
        # rotary embeddings rotate pairs of channels: each head needs an even width
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be num_heads ({self.num_heads}) "
                "times an even head width"
            )
        return self


class ModelConfig(Section):
    base: str | None = Field(
        default=None,
        description="Local Hugging Face model folder to start from; null builds the embedded tiny policy and tokenizer locally.",
    )
    tiny: TinyModelConfig = Field(
        default_factory=TinyModelConfig,
        description="Shape of the embedded policy (used when base is null).",
    )


class EnvConfig(Section):
    name: str = Field(..., description="Env name: a built-in (arith) or a label for a user env.")
    suite: str | None = Field(
        default=None,
        description="Dotted path 'package.module:Class' of a user EnvSuite; null for built-ins.",
    )
    options: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments passed to the suite's constructor."
    )
    n_train: int = Field(default=2000, ge=1, description="Training tasks generated for this env.")
    n_val: int = Field(
        default=256,
        ge=0,
        description="Validation tasks (their own split, disjoint from train and test): they stop training and select checkpoints; the test split is never read for that.",
    )
    n_test: int = Field(
        default=200, ge=1, description="Held-out test tasks generated for this env."
    )
    max_steps: int = Field(
        default=8,
        ge=1,
        description="Agent turns per episode before it is cut (finish reason max_steps).",
    )


class OpenAIEngineSection(Section):
    """Where the ``openai`` engine sends its requests, and how hard it tries."""

    base_urls: list[str] = Field(
        default_factory=list,
        description="OpenAI-compatible servers (e.g. http://10.0.0.5:8000), requests spread round-robin; empty = each rollout stage starts `flywheel serve-policy` on its own policy on 127.0.0.1 and stops it afterwards.",
    )
    model: str | None = Field(
        default=None,
        description="Model name to request from base_urls (null: the first one the server lists).",
    )
    concurrency: int = Field(default=64, ge=1, description="Requests in flight per server at most.")
    timeout_s: float = Field(
        default=120.0, gt=0, description="Seconds per request before it is retried."
    )
    retries: int = Field(
        default=3,
        ge=0,
        description="Retries of a request after a connection error, timeout or 5xx, with exponential backoff.",
    )
    startup_timeout_s: float = Field(
        default=120.0, gt=0, description="Seconds a started server may take to become healthy."
    )

    @field_validator("base_urls")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
                raise ValueError(f"{url!r} is not an http(s) URL")
        return urls


class VLLMEngineSection(Section):
    """The vLLM server a rollout stage starts on its policy (from its own Python environment)."""

    python: str = Field(
        default=".venv-vllm/bin/python",
        description="The Python of the environment vLLM is installed in (`make vllm-env` creates it).",
    )
    max_model_len: int = Field(default=2048, ge=16, description="vLLM's --max-model-len.")
    args: list[str] = Field(
        default_factory=lambda: ["--enable-prefix-caching"],
        description="More arguments for vLLM's OpenAI server (e.g. --tensor-parallel-size 2, --enforce-eager).",
    )
    startup_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Seconds the server may take to load the policy and become healthy.",
    )


class EngineConfig(Section):
    kind: Literal["hf", "openai", "vllm"] = Field(
        default="hf",
        description="Generation engine: hf (in-process transformers), openai (OpenAI-compatible servers, or `flywheel serve-policy` started per stage), vllm (a vLLM server started per stage).",
    )
    batch_size: int = Field(default=256, ge=1, description="Chats per generate call.")
    max_new_tokens: int = Field(default=48, ge=1, description="Tokens per assistant turn at most.")
    prefix_cache: bool = Field(
        default=True,
        description="hf: keep each episode's KV cache between turns, so a turn runs only its new tokens through the model (false: recompute the whole prompt every turn; same results within float rounding).",
    )
    env_workers: int = Field(
        default=8, ge=1, description="Threads stepping environments in parallel."
    )
    openai: OpenAIEngineSection = Field(
        default_factory=OpenAIEngineSection,
        description="The servers of engine.kind openai (and the request settings vllm uses too).",
    )
    vllm: VLLMEngineSection = Field(
        default_factory=VLLMEngineSection, description="The vLLM server of engine.kind vllm."
    )


# Training knobs that change the speed and not the trained weights (beyond float rounding): where
# the ranks run, how a micro-batch is cut into passes, and when the train state is saved. Artifact
# ids and a train state's fingerprint leave them out.
SPEED_ONLY_TRAIN_FIELDS = frozenset(
    {"world_size", "hostfile", "length_split", "checkpoint_every", "checkpoint_minutes"}
)


class TrainSection(Section):
    """The knobs of one training run, shared by every training stage and read by the loop."""

    epochs: int = Field(default=3, ge=1, description="Passes over the training examples.")
    lr: float = Field(default=2e-5, gt=0, description="Peak learning rate.")
    warmup_ratio: float = Field(
        default=0.03, ge=0, le=1, description="Share of steps spent warming up the learning rate."
    )
    schedule: Literal["cosine", "constant"] = Field(
        default="cosine", description="Learning-rate shape after warmup: cosine to 0, or constant."
    )
    micro_batch_size: int = Field(
        default=16, ge=1, description="Sequences per forward pass per rank."
    )
    grad_accum: int = Field(
        default=1,
        ge=1,
        description="Micro-batches per optimizer step, over all ranks: N ranks run grad_accum / N each, so the global batch is micro_batch_size * grad_accum whatever the rank count (a multiple of world_size).",
    )
    max_length: int = Field(default=1024, ge=8, description="Longer sequences are cut at the end.")
    zero_stage: int = Field(default=2, ge=0, le=3, description="DeepSpeed ZeRO stage.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=1.0, ge=0, description="Gradient norm clip (0 disables).")
    bucket_batches: int = Field(
        default=1,
        ge=1,
        description="Batches sorted by length together to cut padding; 1 = plain shuffle (sorting makes batches alike and slowed SFT on arith).",
    )
    checkpoint_every: int = Field(
        default=0,
        ge=0,
        description="Save resumable training state (optimizer, data position) every N steps; 0 = by time only (checkpoint_minutes).",
    )
    checkpoint_minutes: float = Field(
        default=15.0,
        ge=0,
        description="Also save that state once this many minutes have passed since the last save (or the start), so a killed step resumes and loses at most this much; 0 = by steps only.",
    )
    max_steps: int | None = Field(
        default=None,
        ge=1,
        description="Stop after this many optimizer steps (null: run all epochs).",
    )
    bf16: bool = Field(
        default=True, description="bf16 weights and compute on an accelerator (always off on CPU)."
    )
    cpu_bf16: bool = Field(
        default=False,
        description="On a CPU: each training forward pass under bf16 autocast (weights, gradients and optimizer stay float32; validation and generation stay float32). Needs a CPU with avx512_bf16 or amx_bf16 (refused elsewhere: emulated bf16 is slower than float32). Other rounding than float32, so part of artifact ids; docs/training.md has its speed.",
    )
    deepspeed_config: str | None = Field(
        default=None,
        description='A DeepSpeed JSON template; its "auto" values are filled from this section. A relative path is read from the current folder, else from the checkout (configs/deepspeed/zero2.json and zero3.json).',
    )
    world_size: int = Field(
        default=1,
        ge=1,
        description="Training ranks on this machine (GPUs; processes on a CPU box); above 1 the stage trains under the deepspeed launcher. Changes the speed, not the result (not part of artifact ids).",
    )
    hostfile: str | None = Field(
        default=None,
        description="A DeepSpeed hostfile ('host slots=N' per line) to train on several machines; the ranks are its slots and world_size is not read. Not part of artifact ids.",
    )
    val_every: int = Field(
        default=0,
        ge=0,
        description="Validate every N optimizer steps (and before the first): keep the best checkpoint and stop after `patience` validations without improvement; 0 = no validation, keep the last.",
    )
    val_metric: Literal["loss", "success"] = Field(
        default="success",
        description="Validation signal: loss = masked CE of the policy on the val split's expert trajectories; success = greedy success on the val tasks.",
    )
    patience: int = Field(
        default=3,
        ge=1,
        description="Validations without improvement before training stops early.",
    )
    min_delta: float = Field(
        default=0.0,
        ge=0,
        description="A validation improves only when it beats the best by more than this.",
    )
    lr_drops: int = Field(
        default=0,
        ge=0,
        description="With validation: when patience runs out, go back to the best checkpoint, multiply the lr by lr_drop_factor, reset the optimizer's moments and continue with fresh patience, up to this many times; 0 = stop at the first plateau.",
    )
    lr_drop_factor: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        description="What each of the lr_drops multiplies the learning rate by.",
    )

    @model_validator(mode="after")
    def _ranks_share_steps(self) -> TrainSection:
        # Each rank runs grad_accum / world_size micro-batches per step (see grad_accum).
        if self.hostfile is None and self.grad_accum % self.world_size:
            raise ValueError(
                f"grad_accum ({self.grad_accum}) must be a multiple of world_size "
                f"({self.world_size}): the ranks share each step's micro-batches"
            )
        return self

    def result_dump(self, exclude: set[str] | None = None) -> dict[str, Any]:
        """The fields that decide the trained weights: all but ``SPEED_ONLY_TRAIN_FIELDS``.
        ``cpu_bf16`` is in it only when on, so the ids and train states of runs from before it
        existed stay the same."""
        dump = self.model_dump(exclude={*SPEED_ONLY_TRAIN_FIELDS, *(exclude or set())})
        if dump.get("cpu_bf16") is False:
            del dump["cpu_bf16"]
        return dump

    def artifact_dump(self, exclude: set[str] | None = None) -> dict[str, Any]:
        """The fields artifact ids hash: ``result_dump``'s."""
        exclude = exclude or set()
        dump = self.result_dump(exclude)
        if "checkpoint_every" not in exclude:
            # Hashed as its old default, so the ids of runs from before the cadence stopped
            # counting stay the same (and a run that saves more often is still a cache hit).
            dump["checkpoint_every"] = 0
        return dump

    def deepspeed_template(self) -> Path | None:
        """deepspeed_config as a path: as written when it exists (or is absolute), else relative
        to the checkout, so configs/deepspeed/zero3.json works from any folder."""
        if self.deepspeed_config is None:
            return None
        path = Path(self.deepspeed_config)
        if path.is_absolute() or path.is_file():
            return path
        in_checkout = Path(__file__).resolve().parents[1] / path
        return in_checkout if in_checkout.is_file() else path


def rank_count(cfg: TrainSection) -> int:
    """Ranks the run uses: the hostfile's slots when there is one, else cfg.world_size."""
    if cfg.hostfile is None:
        return cfg.world_size
    path = Path(cfg.hostfile)
    if not path.is_file():
        raise ConfigError(f"config error: hostfile: no such file {cfg.hostfile}")
    slots = 0
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"\S+\s+slots=(\d+)", line)
        if match is None:
            raise ConfigError(
                f"config error: hostfile {cfg.hostfile}: expected 'host slots=N', got {line!r}"
            )
        slots += int(match.group(1))
    if slots == 0:
        raise ConfigError(f"config error: hostfile {cfg.hostfile} names no slots")
    if cfg.grad_accum % slots:
        raise ConfigError(
            f"config error: grad_accum ({cfg.grad_accum}) must be a multiple of the hostfile's "
            f"{slots} slots: the ranks share each step's micro-batches"
        )
    return slots


class SftLossSection(TrainSection):
    """A training section whose loss is the masked CE (sft, sft_more, rft)."""

    length_split: int = Field(
        default=1,
        ge=1,
        description="Run each micro-batch as this many forward/backward passes over slices of similar length (sorted, equal counts), each slice's loss weighted by its share of the micro-batch's trained tokens: the same examples and gradient per step (to float rounding) with less padding; 1 = one pass. Changes the speed, not the result (not part of artifact ids).",
    )


class SftConfig(SftLossSection):
    """Round 0: the bootstrap policy on the expert trajectories; later rounds: good paths."""

    with_expert: bool = Field(
        default=False,
        description="In rounds >= 1, train on the demonstrations too, not only the round's successful explored trajectories (each round an RFT step, as in ETO's RFT).",
    )
    round_lr: float | None = Field(
        default=None,
        gt=0,
        description="Peak learning rate of the SFT steps of rounds >= 1 (null: lr): continuing a converged policy wants a smaller step than training it from scratch.",
    )
    round_val_metric: Literal["loss", "success"] = Field(
        default="success",
        description="Validation signal of the SFT steps of rounds >= 1 (round 0 uses val_metric): the loss on demonstrations rises as soon as the policy learns its own successes' wording, whether or not it gets better.",
    )
    round_patience: int | None = Field(
        default=None,
        ge=1,
        description="Patience of the SFT steps of rounds >= 1 (null: patience). Their greedy val success moves a few points between validations, as rft's does: compare rounds and rft at the same patience.",
    )
    replay: bool = Field(
        default=False,
        description="In rounds >= 2, train on the successes of every earlier round's explorations too (grpo.resample's included), the data rft reads, not only this round's.",
    )
    restarts: int = Field(
        default=1,
        ge=1,
        description='Round 0: train the bootstrap this many times from the initial policy, with data orders train_seed, + 1, ..., each until validation stops it, and keep the run with the best validation score. A run from scratch can stop on a plateau that another data order leaves (docs/results.md, "The bootstrap\'s plateau"); costs up to this many bootstraps. Needs val_every > 0.',
    )
    restart_until: float | None = Field(
        default=None,
        description="Round 0 with restarts > 1: train no more runs once one reaches this best validation score (the score the log prints: minus the val loss for val_metric loss, so -0.25 stops at the first run below val loss 0.25). A run that leaves the plateau costs one bootstrap; only a stuck one pays for the next. null: train all the restarts. Ignored (and not hashed) with restarts 1.",
    )

    @model_validator(mode="after")
    def _restarts_need_validation(self) -> SftConfig:
        if self.restarts > 1 and not self.val_every:
            raise ValueError(
                f"restarts ({self.restarts}) keeps the run with the best validation score, "
                "so it needs val_every > 0"
            )
        return self

    def result_dump(self, exclude: set[str] | None = None) -> dict[str, Any]:
        """As for any training section, without ``restarts`` and ``restart_until``: they say
        how many runs the bootstrap makes, not what one of them computes (train-state
        fingerprints)."""
        return super().result_dump({"restarts", "restart_until"} | (exclude or set()))

    def artifact_dump(self, exclude: set[str] | None = None) -> dict[str, Any]:
        """As for any training section; ``round_patience`` only when set, so runs from before
        the field keep their ids. ``replay`` never: it decides which explorations the step
        reads, and their ids are among its inputs. ``restarts`` only above 1 and
        ``restart_until`` only when set with them (and neither in rounds >= 1, which exclude them: they do
        not restart)."""
        skip = {"round_patience"} if self.round_patience is None else set()
        dump = super().artifact_dump(skip | {"replay"} | (exclude or set()))
        if self.restarts > 1 and "restarts" not in (exclude or set()):
            dump["restarts"] = self.restarts
        if (
            self.restarts > 1
            and self.restart_until is not None
            and "restart_until" not in (exclude or set())
        ):
            dump["restart_until"] = self.restart_until
        return dump


class BaselineSection(SftLossSection):
    """A baseline's training knobs, with a seed of its own so its spread can be measured alone."""

    seed: int | None = Field(
        default=None,
        description="Seed of this baseline's data order (null: run.train_seed, else run.seed); changing it retrains only this baseline and its evaluation.",
    )
    repeats: int = Field(
        default=1,
        ge=1,
        description="Train and evaluate this baseline this many times, with data orders seed, seed + 1, ...; the report measures the rounds against the repeats' task-by-task mean (one run's data order moves it by about 3 points on arith).",
    )

    def artifact_dump(self, exclude: set[str] | None = None) -> dict[str, Any]:
        """As for any training section, without ``seed``: the stage hashes the resolved seed
        (``Config.baseline_seed``), so a null seed keeps the ids it had before the field.
        ``repeats`` says how many runs, not what one of them computes."""
        return super().artifact_dump({"seed", "repeats"} | (exclude or set()))


class SftMoreConfig(BaselineSection):
    match: Literal["tokens", "steps"] = Field(
        default="tokens",
        description="Compute matching: train as many tokens (or optimizer steps) as the rounds' training steps used, summed from their manifests.",
    )


class RftConfig(BaselineSection):
    with_expert: bool = Field(
        default=True,
        description="Train on the expert trajectories too (ETO's RFT: demonstrations augmented with the policy's successes); false = successes only.",
    )
    per_task: int = Field(
        default=1,
        ge=1,
        description="Successful samples kept per task: the best by Pareto rank (reward up, tool calls down, tokens down), identical texts once.",
    )


class TasksConfig(Section):
    pass


class ExpertDataConfig(Section):
    """One file of demonstrations standing in for an env's oracle (docs/data.md)."""

    path: str = Field(
        ...,
        description="File of demonstrations, relative to the current folder: ETO or AgentGym conversation JSON, or OpenAI-messages JSONL.",
    )
    format: Literal["eto", "agentgym", "openai"] = Field(
        ..., description="The file's format (flywheel/interchange.py)."
    )
    env: str = Field(..., description="Name of the env (under envs) these demonstrations are for.")
    split: Literal["train", "val"] = Field(
        default="train",
        description="Split of the records that name none: train ones are trained on, val ones are what sft's validation loss is measured on.",
    )


class ExpertConfig(Section):
    n_tasks: int | None = Field(
        default=None,
        ge=0,
        description="Demonstrations for N train tasks of each env only, spread evenly over the split (null: all); the rest are reward-only tasks that exploration learns from.",
    )
    data: list[ExpertDataConfig] = Field(
        default_factory=list,
        description="Imported demonstrations: an env named by an entry takes its train and val trajectories from these files instead of its oracle (n_tasks does not apply to them); the artifact id hashes the files' contents (docs/data.md).",
    )


class ExploreConfig(Section):
    samples_per_task: int = Field(default=4, ge=1, description="K rollouts per training task.")
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling threshold.")
    n_tasks: int | None = Field(
        default=None,
        ge=1,
        description="Explore N training tasks per env per round: round r takes the r-th N, wrapping around the train split (null: all, every round).",
    )
    shard_size: int = Field(
        default=256,
        ge=1,
        description="Episodes per Parquet shard; finished shards survive a crash.",
    )


class EvaluateConfig(Section):
    temperature: float = Field(
        default=0.0, ge=0, description="0 = greedy decoding (the default for evaluation)."
    )
    n_tasks: int | None = Field(
        default=None, ge=1, description="Evaluate on the first N test tasks per env (null: all)."
    )
    shard_size: int = Field(default=256, ge=1, description="Episodes per Parquet shard.")
    untrained: bool = Field(
        default=False,
        description="Also evaluate the untrained starting policy in round 0 (0% for the embedded policy, and the slowest evaluation: every episode runs to max_steps).",
    )
    val_tasks: int | None = Field(
        default=None,
        ge=1,
        description="Validation by success (val_metric: success) runs the first N val tasks per env (null: all of n_val).",
    )


class ParetoConfig(Section):
    margin: float = Field(
        default=0.0,
        ge=0,
        description="best_worst pairs need reward(best) - reward(worst) > margin (strictly).",
    )
    expert_pairs: bool = Field(
        default=True,
        description="ETO pairs: every explored sample against its task's expert trajectory; the higher reward is chosen, ties give no pair.",
    )
    best_worst_pairs: bool = Field(
        default=True,
        description="Also pair the best and the worst of a task's K samples (ours), so pairs exist without an expert.",
    )
    prefer_pareto_rank: bool = Field(
        default=True,
        description="Among samples of equal reward, pick best/worst by per-trajectory Pareto rank (reward up, tool calls down, tokens down) before tokens.",
    )
    budget: int | None = Field(
        default=1024,
        ge=0,
        description="GRPO groups to select, counted after the post-filter; null keeps every group that passes it.",
    )
    cut_extra_messages: int = Field(
        default=10,
        ge=0,
        description="The rejected side keeps at most len(chosen trajectory) + this many messages (ETO: len(expert) + 10).",
    )
    graded_threshold: float = Field(
        default=0.75,
        ge=0,
        le=1,
        description="Graded (non-binary reward) groups need one reward >= this and one below it.",
    )
    shard_rows: int = Field(
        default=50_000,
        ge=1,
        description="Rows per Parquet shard of the pairs and groups artifacts.",
    )


class DpoConfig(TrainSection):
    beta: list[float] = Field(
        default=[0.1, 0.5],
        min_length=1,
        description="DPO inverse temperature per round: round r uses entry r-1, the last one for later rounds (ETO: 0.1, then 0.5).",
    )
    lr: list[float] = Field(  # type: ignore[assignment]
        default=[1e-6, 5e-7],
        min_length=1,
        description="Peak learning rate per round, indexed like beta (ETO at 7B: 1e-6, then 5e-7; the tiny policy needs ~1e-3).",
    )
    epochs: int = Field(default=3, ge=1, description="Passes over the pairs (ETO: 3).")
    nll_weight: float = Field(
        default=0.0,
        ge=0,
        description="Ours: add this times the token-mean NLL of the chosen side to the DPO loss (0 = pure DPO as in ETO); keeps small policies from collapsing.",
    )
    reference: Literal["precomputed", "frozen"] = Field(
        default="precomputed",
        description="precomputed: score every pair with the starting policy once before training (saved as ref_logps.parquet); frozen: keep a frozen copy of it in memory and score each batch.",
    )

    @field_validator("beta", "lr")
    @classmethod
    def _positive(cls, values: list[float]) -> list[float]:
        if any(v <= 0 for v in values):
            raise ValueError(f"every entry must be > 0, got {values}")
        return values


class GrpoConfig(TrainSection):
    lr: float = Field(
        default=1e-6,
        gt=0,
        description="Peak learning rate (1e-6 suits a 7B policy; the tiny embedded policy needs ~1e-4).",
    )
    epochs: int = Field(
        default=1, ge=1, description="Passes over the selected trajectories (on-policy: 1)."
    )
    clip: float = Field(
        default=0.2, gt=0, description="PPO ratio clip: the ratio is kept in [1 - clip, 1 + clip]."
    )
    kl_coef: float = Field(
        default=0.0,
        ge=0,
        description="Weight of 0.5*(logp - logp_ref)^2 to the starting policy (Trinity: 0.001); > 0 keeps a frozen copy in memory.",
    )
    efficiency_reward: bool = Field(
        default=False,
        description="Train on ET-Agent's R = raw * f_tool * f_len + f_format instead of the env reward.",
    )
    s_tool: float = Field(
        default=0.2,
        ge=0,
        description="Efficiency reward: tool-call sharpness in round 1, annealed linearly to 0 over rounds 1..run.rounds.",
    )
    s_len: float = Field(
        default=0.5,
        ge=0,
        description="Efficiency reward: length sharpness in round 1, annealed like s_tool.",
    )
    drop_flat_groups: bool = Field(
        default=True,
        description="Drop groups whose (shaped) rewards are all equal: their advantages are 0 and would only dilute the token mean.",
    )
    expert_weight: float = Field(
        default=0.0,
        ge=0,
        lt=1,
        description="MIX (Trinity-RFT, mu there, 0.1): loss = (1 - w) * GRPO + w * token-mean NLL of the MIX rows (mix_source: expert trajectories of this round's unsolved tasks by default); 0 = plain GRPO.",
    )
    expert_ratio: float = Field(
        default=0.5,
        gt=0,
        lt=1,
        description="MIX: its NLL rows as a share of all trained trajectories (Trinity-RFT: 0.5), capped by the rows there are (unsolved tasks with an expert trajectory, or solved tasks with mix_source own).",
    )
    mix_source: Literal["expert", "own"] = Field(
        default="expert",
        description="MIX's NLL rows: expert (Trinity-RFT) = expert trajectories of the explored tasks no sample solved; own = the policy's best successful sample of each solved task of the exploration its groups came from, chosen as rft chooses (self-imitation: the step also imitates its own successes, which GRPO's all-solved groups leave untrained). Both capped by expert_ratio.",
    )
    failure_credit: Literal["trajectory", "departure"] = Field(
        default="trajectory",
        description="Which tokens of a below-average sample carry its negative advantage: every generated one (trajectory, the published rule) or those up to its departure from the better samples of its group (departure: the first token where it leaves all of them; docs/credit.md).",
    )

    resample: bool = Field(
        default=False,
        description="Sample GRPO's groups again with the policy it starts from when an earlier step of the round changed that policy (sft in [sft, grpo]): a second explore and pareto of the round's tasks. false: train on the round's first groups, which the policy before that step sampled (docs/results.md: the step then learns from advantages that no longer fit).",
    )

    def artifact_dump(self, exclude: set[str] | None = None) -> dict[str, Any]:
        """As for any training section; ``failure_credit`` and ``mix_source`` only when they are
        not the published rule, so runs from before those fields keep their ids. ``resample``
        never: it decides which groups artifact the stage reads, and that artifact's id is
        among its inputs."""
        skip = {"failure_credit"} if self.failure_credit == "trajectory" else set()
        skip |= {"mix_source"} if self.mix_source == "expert" else set()
        return super().artifact_dump(skip | {"resample"} | (exclude or set()))


class MctsConfig(Section):
    """UCT search over env actions from the round's policy (ALGORITHMS.md, "MCTS tree expansion")."""

    n_tasks: int | None = Field(
        default=None,
        ge=1,
        description="Search one tree for each of N training tasks per env per round: round r takes the r-th N, wrapping around the train split, as explore.n_tasks does (null: all, every round). With tasks: unsolved, at most N of those tasks.",
    )
    tasks: Literal["window", "unsolved"] = Field(
        default="window",
        description="Which train tasks get a tree: window = the round's window of n_tasks tasks (as explore takes its own); unsolved = the tasks of the round's exploration that none of its samples solved, so the search spends its budget where sampling found nothing and its good paths cover tasks the explore data (and rft) lack. unsolved needs explore in iteration.data.",
    )
    iterations: int = Field(
        default=4, ge=1, description="UCT walks from the root of every tree (Agent-R: 4)."
    )
    max_depth: int = Field(
        default=10,
        ge=1,
        description="Actions from the root at most; a node this deep is terminal with reward 0 unless the env ended the episode there (Agent-R: 10).",
    )
    n_gen: int = Field(
        default=4,
        ge=1,
        description="Assistant turns sampled per expansion; identical actions are kept once (Agent-R: 4).",
    )
    c: float = Field(
        default=0.25,
        ge=0,
        description="UCT exploration weight in Q/N + c*sqrt(ln N_parent / N) (Agent-R: 0.25).",
    )
    temperature: float = Field(
        default=1.0, ge=0, description="Sampling temperature of the expansions."
    )
    shard_size: int = Field(
        default=64,
        ge=1,
        description="Trees per Parquet shard (searched together, one batched generate call per tree level); finished shards survive a crash.",
    )


class SpliceConfig(Section):
    """Revision trajectories from the round's trees (ALGORITHMS.md, "Revision splicing")."""

    alpha: float = Field(
        default=0.5,
        ge=0,
        description="A good path's leaf value must exceed this (Agent-R's lower bound for a good trajectory).",
    )
    beta: float = Field(
        default=0.2,
        ge=0,
        description="A bad path is revised onto a good one only when their leaf values differ by more than this (Agent-R's distinguishable gap).",
    )
    verifier: Literal["rule", "judge"] = Field(
        default="rule",
        description="How a bad path's first error is found: rule = the env's step signals (invalid action, env error, failed tool call, lost progress); judge = the policy asked Good/Bad/Uncertain about every step, in one batched greedy call.",
    )
    judge_max_new_tokens: int = Field(
        default=64,
        ge=1,
        description="verifier judge: tokens of each verdict at most (a sentence and the Judgement line).",
    )
    good_paths: bool = Field(
        default=True,
        description="Also write every good path as a trajectory (source mcts), which round sft trains on next to the revisions (Agent-R mixes both).",
    )
    revisions: bool = Field(
        default=True,
        description="Write revision trajectories (bad prefix, revision turn, good continuation); false = the good paths alone: search as a solver, for a policy that cannot tell when to revise (on arith a miscopied number looks like a right one). Without revisions an env needs no no-op action.",
    )
    thoughts: list[str] | None = Field(
        default=None,
        description="The reflections revision turns open with (`Thought: <one of them>`), one picked per revision by a stable hash; null = the eight published ones (flywheel.splice.REVISION_THOUGHTS). A small policy may learn one short thought where it garbles eight long ones. The policy's tokenizer must spell each (the embedded one knows the published thoughts' words).",
    )
    shard_rows: int = Field(
        default=4096, ge=1, description="Trajectories per Parquet shard of the artifact."
    )

    @field_validator("thoughts")
    @classmethod
    def _one_line_thoughts(cls, thoughts: list[str] | None) -> list[str] | None:
        # the revision turn is `Thought: <thought>\nAction: <no-op>`: a line break would split it
        if thoughts is None:
            return None
        if not thoughts:
            raise ValueError("must hold at least one thought, or be null for the published ones")
        for thought in thoughts:
            if not thought.strip() or "\n" in thought:
                raise ValueError(f"each thought must be one non-empty line, got {thought!r}")
        return thoughts


class ReflectConfig(Section):
    """Reflection by hint on the round's failed explored trajectories (ALGORITHMS.md, "Reflection by hint")."""

    n_tasks: int | None = Field(
        default=None,
        ge=1,
        description="Reflect on the failed trajectories of at most N tasks per env: the first N explored tasks with a failure (null: every failed trajectory).",
    )
    max_evolve_times: int = Field(
        default=3,
        ge=1,
        description="Attempts per failed trajectory: a continuation that fails too is reflected on again, from its first flawed step after the hint (ET-Agent: 3).",
    )
    temperature: float = Field(
        default=1.0, ge=0, description="Sampling temperature of the continuations."
    )
    shard_size: int = Field(
        default=64,
        ge=1,
        description="Failed trajectories per Parquet shard (continued together, one batched generate call per step); finished shards survive a crash.",
    )


TrainStep = Literal["sft", "dpo", "grpo"]
RoundData = Literal["explore", "mcts", "reflect"]
Baseline = Literal["sft_more", "rft"]
BASELINES: tuple[str, ...] = get_args(Baseline)  # the baseline stages, by name
# Training steps that read what only explore produces (pareto's pairs and groups).
NEEDS_EXPLORE: tuple[str, ...] = ("dpo", "grpo")


def _default_steps() -> list[TrainStep]:
    return ["dpo"]


def _default_data() -> list[RoundData]:
    return ["explore"]


class IterationConfig(Section):
    data: list[RoundData] = Field(
        default_factory=_default_data,
        min_length=1,
        description="What each round's policy produces for the round to train on: explore (K rollouts per task, mined by pareto into DPO pairs and GRPO groups), mcts (search trees, spliced by splice into revision trajectories and good paths) and/or reflect (explore's failed trajectories continued from a reflection hint; the successes are revision trajectories). Round sft trains on all of it; dpo, grpo and reflect need explore.",
    )
    steps: list[TrainStep] = Field(
        default_factory=_default_steps,
        min_length=1,
        description="Training steps of every round after the bootstrap, in order; each starts from the previous step's checkpoint (e.g. [dpo], [grpo], [sft, dpo]).",
    )
    repeats: int = Field(
        default=1,
        ge=1,
        description="Train the last round's steps this many times on that round's data, with training seeds run.train_seed (else run.seed), + 1, ..., and evaluate each; the report measures the last round by the task-by-task mean of its repeats, as it does a baseline's repeats (one training run's test success moves by several points with its data order alone). Only a whole `flywheel run` trains them, after the baselines; the first is the round itself.",
    )

    @model_validator(mode="after")
    def _data_for_steps(self) -> IterationConfig:
        if len(set(self.data)) != len(self.data):
            raise ValueError(f"data must not repeat an entry, got {self.data}")
        if "reflect" in self.data and "explore" not in self.data:
            raise ValueError(
                f"reflect in data reflects on explore's failed trajectories: add explore to data "
                f"(got data={self.data})"
            )
        needs = [s for s in self.steps if s in NEEDS_EXPLORE]
        if needs and "explore" not in self.data:
            raise ValueError(
                f"steps {needs} train on explore's pairs and groups: add explore to data "
                f"(got data={self.data})"
            )
        return self


class TrackingConfig(Section):
    enabled: bool = Field(
        default=True, description="Log runs, params, metrics and manifests to MLflow."
    )
    uri: str | None = Field(
        default=None, description="MLflow tracking URI; default sqlite:///<work_dir>/mlflow.db."
    )
    experiment: str = Field(default="agent-flywheel", description="MLflow experiment name.")


class Config(Section):
    run: RunConfig = Field(
        default_factory=RunConfig, description="Run identity, paths and the number of rounds."
    )
    model: ModelConfig = Field(default_factory=ModelConfig, description="The policy to start from.")
    envs: list[EnvConfig] = Field(
        default_factory=lambda: [EnvConfig(name="arith")],
        min_length=1,
        description="Environments trained and evaluated on.",
    )
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="How the policy generates."
    )
    tasks: TasksConfig = Field(
        default_factory=TasksConfig, description="Task generation (sizes live on each env)."
    )
    expert: ExpertConfig = Field(
        default_factory=ExpertConfig, description="Expert trajectories from the envs' oracles."
    )
    sft: SftConfig = Field(
        default_factory=SftConfig, description="Supervised fine-tuning on expert trajectories."
    )
    explore: ExploreConfig = Field(
        default_factory=ExploreConfig, description="Exploration rollouts of the current policy."
    )
    pareto: ParetoConfig = Field(
        default_factory=ParetoConfig,
        description="Pairs, group selection and Pareto ranks from explored trajectories.",
    )
    dpo: DpoConfig = Field(default_factory=DpoConfig, description="DPO on the round's pairs (ETO).")
    grpo: GrpoConfig = Field(
        default_factory=GrpoConfig,
        description="GRPO on the round's selected groups (ET-Agent / Trinity).",
    )
    mcts: MctsConfig = Field(
        default_factory=MctsConfig,
        description="MCTS trees searched by the round's policy (with mcts in iteration.data).",
    )
    splice: SpliceConfig = Field(
        default_factory=SpliceConfig,
        description="Revision trajectories and good paths from the round's trees (Agent-R).",
    )
    reflect: ReflectConfig = Field(
        default_factory=ReflectConfig,
        description="Reflection by hint on the round's failed explored trajectories (with reflect in iteration.data; ET-Agent).",
    )
    iteration: IterationConfig = Field(
        default_factory=IterationConfig,
        description="What a round after the bootstrap learns from and trains with.",
    )
    baselines: list[Baseline] = Field(
        default_factory=list,
        description="Baselines trained after the last round and evaluated on the same test tasks: sft_more (the SFT policy trained further on the expert data, compute-matched to the rounds), rft (SFT on the policy's own successful explored trajectories).",
    )
    sft_more: SftMoreConfig = Field(
        default_factory=SftMoreConfig,
        description="Baseline: SFT continued on the expert data with the rounds' compute.",
    )
    rft: RftConfig = Field(
        default_factory=RftConfig,
        description="Baseline: rejection-sampling fine-tuning on the rounds' successful explored trajectories.",
    )
    evaluate: EvaluateConfig = Field(
        default_factory=EvaluateConfig, description="Held-out evaluation."
    )
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow tracking.")

    @model_validator(mode="after")
    def _unique_envs(self) -> Config:
        names = [e.name for e in self.envs]
        if len(set(names)) != len(names):
            raise ValueError(f"env names must be unique, got {names}")
        if len(set(self.baselines)) != len(self.baselines):
            raise ValueError(f"baselines must be unique, got {self.baselines}")
        if self.mcts.tasks == "unsolved" and "explore" not in self.iteration.data:
            raise ValueError(
                "mcts.tasks=unsolved searches the tasks explore did not solve: add explore to "
                f"iteration.data (got {self.iteration.data})"
            )
        if not self.splice.revisions and not self.splice.good_paths:
            raise ValueError(
                "splice.revisions=false and splice.good_paths=false leave splice nothing to write"
            )
        steps = self.iteration.steps
        if self.grpo.resample and ("grpo" not in steps or steps.index("grpo") == 0):
            raise ValueError(
                "grpo.resample=true samples again for a grpo step that follows another step of "
                f"the round (iteration.steps=[sft, grpo]); got [{', '.join(steps)}]"
            )
        if self.grpo.mix_source == "own" and self.grpo.expert_weight == 0:
            raise ValueError(
                "grpo.mix_source=own needs grpo.expert_weight > 0 (the weight of its NLL term)"
            )
        return self

    @field_validator("baselines")
    @classmethod
    def _rft_needs_explore(cls, baselines: list[str], info: ValidationInfo) -> list[str]:
        iteration = info.data.get("iteration")  # validated before baselines (field order)
        if "rft" in baselines and iteration is not None and "explore" not in iteration.data:
            raise ValueError(
                "rft trains on the rounds' explore data: add explore to iteration.data "
                f"(got {iteration.data}) or drop rft"
            )
        return baselines

    @property
    def train_seed(self) -> int:
        """The seed of model init, data order and the training stages' draws: ``run.train_seed``,
        or ``run.seed`` when that is null (tasks and exploration always use ``run.seed``)."""
        return self.run.seed if self.run.train_seed is None else self.run.train_seed

    def baseline_seed(self, section: BaselineSection) -> int:
        """A baseline's training seed: its own ``seed``, else the run's training seed."""
        return self.train_seed if section.seed is None else section.seed

    def envs_dump(self) -> list[dict[str, Any]]:
        """Every env's settings but the task counts (those shape the tasks artifacts, whose ids
        the later stages hash as inputs), as the stages that generate or roll out tasks hash them."""
        dumps = [e.model_dump(exclude={"n_train", "n_val", "n_test"}) for e in self.envs]
        for dump in dumps:
            # Where a built index lies says nothing of its content (its settings are the other
            # options): a store moved elsewhere, or a round run without the bootstrap that
            # attached it, keeps the same ids.
            dump["options"].pop("index_dir", None)
        return dumps

    def engine_dump(self) -> dict[str, Any]:
        """The engine settings that change what is generated: not the env thread count, the
        prefix cache (it changes the cost, not the result), nor where servers are and how they
        are reached; the model an external server is asked for is part of it."""
        dump = self.engine.model_dump(exclude={"env_workers", "prefix_cache", "openai", "vllm"})
        if self.engine.kind == "openai" and self.engine.openai.base_urls:
            dump["served_model"] = self.engine.openai.model
        return dump

    def tracking_uri(self) -> str:
        if self.tracking.uri:
            return self.tracking.uri
        return "sqlite:///" + str((Path(self.run.work_dir) / "mlflow.db").resolve())


# ---------------------------------------------------------------------------------------------


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node: Any = data
    parts = dotted.split(".")
    for i, part in enumerate(parts[:-1]):
        if isinstance(node, list):
            node = _list_item(node, part, ".".join(parts[: i + 1]))
            continue
        node = node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(
                f"config override {dotted}: {'.'.join(parts[: i + 1])} is not a section"
            )
    last = parts[-1]
    if isinstance(node, list):
        # envs.arith.n_test=50 addresses the list entry by name
        raise ConfigError(
            f"config override {dotted}: name a field of a list entry, e.g. envs.<name>.<field>"
        )
    node[last] = value


def _list_item(items: list[Any], key: str, where: str) -> Any:
    for item in items:
        if isinstance(item, dict) and item.get("name") == key:
            return item
    if key.isdigit() and int(key) < len(items):
        return items[int(key)]
    raise ConfigError(f"config override: no entry named {key!r} in {where.rsplit('.', 1)[0]}")


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ConfigError(f"config override {text!r}: expected key.sub=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"config override {text!r}: empty key")
    try:
        value = _load_yaml(raw) if raw.strip() else ""
    except DuplicateKeyError as err:
        raise ConfigError(f"config override {key}: {err.problem}") from None
    except yaml.YAMLError:
        value = raw
    return key, value


def _format_error(err: ValidationError, data: dict[str, Any] | None = None) -> str:
    first = err.errors()[0]
    parts = list(first["loc"])
    envs = (data or {}).get("envs")
    if (
        len(parts) > 1
        and parts[0] == "envs"
        and isinstance(parts[1], int)
        and isinstance(envs, list)
    ):
        entry = envs[parts[1]] if parts[1] < len(envs) else None
        if isinstance(entry, dict) and isinstance(entry.get("name"), str):
            parts[1] = entry["name"]  # envs.arith.n_train, as overrides address it
    loc = ".".join(str(p) for p in parts) or "<root>"
    kind = first["type"]
    if kind == "extra_forbidden":
        return f"config error: unknown key {loc}"
    if kind == "missing":
        return f"config error: missing required key {loc}"
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    msg = first["msg"].removeprefix("Value error, ")
    value = first.get("input")
    if not isinstance(value, (dict, list, BaseModel)) and "got " not in msg:
        msg += f", got {value!r}"
    return f"config error: {loc}: {msg}{more}"


def config_from_dict(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_error(err, data)) from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Read a YAML config (or the defaults when ``path`` is None) and apply overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config error: no such file {path}")
        try:
            loaded = _load_yaml(path.read_text())
        except DuplicateKeyError as err:
            line = err.problem_mark.line + 1 if err.problem_mark else 0
            raise ConfigError(f"config error: {path} line {line}: {err.problem}") from None
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"config error: {path}{where} is not valid YAML") from None
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"config error: cannot read {path}: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config error: {path} must hold a mapping at the top level")
        data = loaded or {}
    if any(o.startswith("envs.") for o in overrides) and "envs" not in data:
        data["envs"] = [e.model_dump() for e in Config().envs]
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return config_from_dict(data)


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(), sort_keys=False)


def field_help(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted key, help text) for every field, recursing into sections."""
    rows: list[tuple[str, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        rows.append((key, field.description or ""))
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(field_help(ann, key + "."))
        for arg in getattr(ann, "__args__", ()):  # list[EnvConfig] -> envs.<name>.<field>
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                rows.extend(field_help(arg, key + ".<name>."))
    return rows


def _type_name(ann: Any) -> str:
    """A field's type as a user writes it in YAML: ``int``, ``float | null``, ``cosine | constant``."""
    origin, args = get_origin(ann), get_args(ann)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (Union, UnionType):
        return " | ".join("null" if a is type(None) else _type_name(a) for a in args)
    if origin is list:
        item = _type_name(args[0]) if args else "any"
        return "list of sections" if item == "section" else f"list of {item}"
    if origin is dict:
        return "mapping"
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return "section"
    return getattr(ann, "__name__", str(ann))


def _bounds(field: Any) -> str:
    words = []
    for meta in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(meta, attr, None) is not None:
                words.append(f"{sign} {getattr(meta, attr)}")
        if getattr(meta, "min_length", None):
            words.append(f"at least {meta.min_length}")
    return ", ".join(words)


def _default_text(field: Any) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    if isinstance(value, list):
        value = [v.name if isinstance(v, EnvConfig) else v for v in value]
    return (
        yaml.safe_dump(value, default_flow_style=True, width=1000)
        .strip()
        .removesuffix("...")
        .strip()
    )


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _reference_rows(fields: dict[str, FieldInfo], prefix: str) -> list[str]:
    rows = []
    for name, field in fields.items():
        key = f"{prefix}{name}"
        kind = _type_name(field.annotation)
        bounds = _bounds(field)
        default = _default_text(field)
        cells = (
            f"`{key}`",
            f"{kind}, {bounds}" if bounds else kind,
            f"`{default}`" if default and default != "required" else default,
            (field.description or "").replace("<", "&lt;"),  # <work_dir> is no HTML tag
        )
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows.extend(_reference_rows(ann.model_fields, key + "."))
        for arg in get_args(ann):  # list[EnvConfig] -> envs.<name>.<field>
            if isinstance(arg, type) and issubclass(arg, BaseModel):
                rows.extend(_reference_rows(arg.model_fields, key + ".<name>."))
    return rows


def config_reference() -> str:
    """docs/config.md: one table per top-level section with every key's type, default and help
    text (``flywheel config --reference``; a test keeps the committed file equal to this)."""
    parts = [
        "# Config reference\n",
        "Generated from the help text in `flywheel/config.py` by "
        "`flywheel config --reference > docs/config.md`; do not edit by hand.\n",
        "A config is a YAML file (`configs/default.yaml` is the demo's) plus `key.sub=value` "
        "overrides on the command line; list entries are addressed by name "
        "(`envs.arith.n_test=500`). Unknown keys, wrong types and out-of-range values are "
        "refused before anything runs. `null` is YAML's none.\n",
    ]
    header = "| key | type | default | help |\n|---|---|---|---|"
    for name, field in Config.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows = _reference_rows(ann.model_fields, f"{name}.")
        else:  # envs, baselines
            rows = _reference_rows({name: field}, "")
        table = f"{header}\n" + "\n".join(rows) if rows else "No keys yet."
        parts.append(f"## `{name}`\n\n{field.description}\n\n{table}\n")
    return "\n".join(parts)
