from pathlib import Path

import pytest

from flywheel.config import Config, ConfigError, field_help, load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_yaml_config_validates(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)


def test_defaults_without_file():
    cfg = load_config(None)
    assert cfg.envs[0].name == "arith" and cfg.run.rounds >= 0


def test_overrides_are_typed_and_nested(tmp_path):
    cfg = load_config(
        ROOT / "configs" / "default.yaml", ["sft.lr=1e-3", "run.rounds=1", "envs.arith.n_test=50"]
    )
    assert cfg.sft.lr == 1e-3 and isinstance(cfg.sft.lr, float)
    assert cfg.run.rounds == 1
    assert cfg.envs[0].n_test == 50


def test_unknown_key_names_its_path(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft:\n  lrr: 0.1\n")
    with pytest.raises(ConfigError, match=r"^config error: unknown key sft\.lrr$"):
        load_config(bad)
    with pytest.raises(ConfigError, match=r"unknown key explore\.k"):
        load_config(None, ["explore.k=3"])


def test_bad_values_and_files(tmp_path):
    with pytest.raises(ConfigError, match=r"sft\.lr"):
        load_config(None, ["sft.lr=-1"])
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("run: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        load_config(None, ["sft.lr"])
    with pytest.raises(ConfigError, match="no entry named 'nope'"):
        load_config(None, ["envs.nope.n_test=3"])
    with pytest.raises(ConfigError, match="explore.n_tasks"):
        load_config(None, ["explore.n_tasks=0"])
    # MIX: weight 1 would drop the GRPO term entirely; a ratio of 1 asks for infinitely many.
    with pytest.raises(ConfigError, match="grpo.expert_weight"):
        load_config(None, ["grpo.expert_weight=1"])
    with pytest.raises(ConfigError, match="grpo.expert_ratio"):
        load_config(None, ["grpo.expert_ratio=0"])
    # null falls back to sft.patience; 0 would stop a round's SFT at its first validation
    with pytest.raises(ConfigError, match=r"sft\.round_patience"):
        load_config(None, ["sft.round_patience=0"])


def test_duplicate_yaml_keys_are_refused_but_merge_keys_work(tmp_path):
    dup = tmp_path / "dup.yaml"
    dup.write_text("sft:\n  lr: 0.1\nexplore:\n  top_p: 0.9\nsft:\n  epochs: 2\n")
    with pytest.raises(ConfigError, match=rf"^config error: {dup} line 5: duplicate key 'sft'$"):
        load_config(dup)
    merged = tmp_path / "merged.yaml"
    merged.write_text("sft: &train\n  lr: 0.1\n  epochs: 2\nsft_more:\n  <<: *train\n  epochs: 5\n")
    cfg = load_config(merged)
    assert (cfg.sft_more.lr, cfg.sft_more.epochs) == (0.1, 5)


def test_floats_are_finite_and_model_shapes_consistent():
    for override in ("explore.temperature=inf", "sft.lr=.nan", "dpo.beta=[.inf]"):
        with pytest.raises(ConfigError, match="finite number"):
            load_config(None, [override])
    with pytest.raises(ConfigError, match=r"model\.tiny: hidden_size \(30\) must be num_heads"):
        load_config(None, ["model.tiny.hidden_size=30"])
    assert load_config(None, ["model.tiny.hidden_size=24", "model.tiny.num_heads=3"])
    with pytest.raises(ConfigError, match=r"run\.name: must be a plain name"):
        load_config(None, ["run.name=../x"])


def test_every_field_has_help():
    missing = [key for key, text in field_help() if not text]
    assert missing == []


def test_artifact_configs_isolate_sections():
    """Each stage's artifact_config (next to its run) says what reruns it: a changed section
    changes the id of the stages that read it and of no other."""
    from flows.flywheel import STAGES
    from flywheel.store import ArtifactRef

    policy = ArtifactRef(id="sft-x", kind="checkpoints", stage="sft", round=0, path="", manifest={})
    calls = {
        "tasks": lambda m, c: [m.artifact_config(c, s) for s in ("train", "val", "test")],
        "sft": lambda m, c: [m.artifact_config(c, 0), m.artifact_config(c, 1)],
        "explore": lambda m, c: m.artifact_config(c, 1),
        "mcts": lambda m, c: m.artifact_config(c, 1),
        "evaluate": lambda m, c: m.artifact_config(c, policy),
        "pareto": lambda m, c: [m.artifact_config(c, a) for a in ("pairs", "groups")],
        "dpo": lambda m, c: m.artifact_config(c, 1),
        "grpo": lambda m, c: m.artifact_config(c, 1),
    }

    def configs(overrides: list[str]) -> dict[str, object]:
        cfg = load_config("configs/default.yaml", overrides)
        return {
            name: calls.get(name, lambda m, c: m.artifact_config(c))(module, cfg)
            for name, module in STAGES.items()
        }

    base = configs([])
    training = {"init", "sft", "dpo", "grpo", "sft_more", "rft"}
    for override, changed in [
        ("evaluate.temperature=0.5", {"evaluate"}),
        ("sft.lr=0.002", {"sft"}),
        ("sft.with_expert=true", {"sft"}),  # its round >= 1 id only (below)
        ("sft.round_patience=10", {"sft"}),  # its round >= 1 id only (below)
        ("sft_more.lr=0.001", {"sft_more"}),
        ("rft.per_task=2", {"rft"}),
        ("dpo.beta=[0.2]", {"dpo"}),
        ("pareto.budget=7", {"pareto"}),
        ("expert.n_tasks=5", {"expert"}),
        ("envs.arith.n_val=9", {"tasks"}),
        ("explore.temperature=0.7", {"explore"}),
        ("reflect.max_evolve_times=2", {"reflect"}),
        ("model.tiny.hidden_size=64", {"init"}),
        ("model.tiny.number_digits=3", {"init"}),
        ("mcts.tasks=unsolved", {"mcts"}),
        ("splice.revisions=false", {"splice"}),
        ("grpo.mix_source=own", {"grpo"}),
        # a baseline's own seed retrains that baseline only
        ("rft.seed=7", {"rft"}),
        ("sft_more.seed=7", {"sft_more"}),
        # the training seed: every training stage, not the tasks, exploration or evaluation
        ("run.train_seed=7", training),
        # the run seed: the tasks and exploration as well
        ("run.seed=7", training | {"tasks", "explore", "mcts", "reflect"}),
    ]:
        other = configs([override])
        assert {n for n in base if base[n] != other[n]} == changed, override
    # fields added later are hashed only when set off their default: older ids stay
    assert "number_digits" not in configs(["model.tiny.number_digits=3"])["init"]["model"]["tiny"]
    assert base["init"]["model"]["tiny"]["number_digits"] == 1  # the default yaml's setting
    assert "tasks" not in base["mcts"]["mcts"] and "revisions" not in base["splice"]["splice"]
    assert "mix_source" not in base["grpo"]["grpo"]
    # a training seed or baseline seed equal to the one it replaces keeps every id
    assert configs(["run.train_seed=0"]) == base
    assert configs(["rft.seed=0", "sft_more.seed=0"]) == base
    # a baseline's seed wins over the training seed
    assert configs(["run.train_seed=7", "rft.seed=0"])["rft"] == base["rft"]
    # the bootstrap SFT does not read sft.with_expert: its id stays
    assert configs(["sft.with_expert=true"])["sft"][0] == base["sft"][0]
    assert configs(["sft.round_val_metric=loss"])["sft"][0] == base["sft"][0]
    assert configs(["sft.round_val_metric=loss"])["sft"][1] != base["sft"][1]
    # round_patience: a new field, hashed only when set, and only by the rounds' SFT steps
    patient = configs(["sft.round_patience=10"])["sft"]
    assert patient[0] == base["sft"][0] and patient[1] != base["sft"][1]
    assert "round_patience" not in base["sft"][1]["sft"]


def test_round_sft_steps_take_their_own_lr_and_patience():
    """The rounds' SFT steps train at round_lr and stop at round_patience; round 0 keeps lr and
    patience; unset, the rounds use them too."""
    from stages.sft import section

    cfg = load_config(
        "configs/default.yaml", ["sft.round_lr=3e-4", "sft.round_patience=10", "sft.patience=4"]
    )
    assert (section(cfg, 0).lr, section(cfg, 0).patience) == (cfg.sft.lr, 4)
    assert (section(cfg, 1).lr, section(cfg, 1).patience) == (3e-4, 10)
    assert section(cfg, 2).val_metric == "success"
    plain = load_config("configs/default.yaml", ["sft.patience=6"])
    assert (section(plain, 1).lr, section(plain, 1).patience) == (plain.sft.lr, 6)


def test_length_split_is_a_speed_knob_of_the_sft_loss_sections():
    base = load_config(None)
    split = load_config(
        None, ["sft.length_split=2", "rft.length_split=3", "sft_more.length_split=2"]
    )
    for name in ("sft", "rft", "sft_more"):
        assert getattr(split, name).length_split > 1
        # The same gradient to float rounding: artifact ids do not change.
        assert getattr(split, name).artifact_dump() == getattr(base, name).artifact_dump()
    assert split.sft.model_dump() != base.sft.model_dump()  # the manifest's config records it
    for name in ("dpo", "grpo"):  # their losses do not split by trained tokens
        with pytest.raises(ConfigError, match=rf"unknown key {name}\.length_split"):
            load_config(None, [f"{name}.length_split=2"])
    with pytest.raises(ConfigError, match=r"sft\.length_split"):
        load_config(None, ["sft.length_split=0"])


TRAINING_SECTIONS = ("sft", "sft_more", "rft", "dpo", "grpo")


def test_cpu_bf16_is_in_artifact_ids_and_train_states_only_when_on():
    from flywheel.training.loop import LossParams, _fingerprint
    from stages import sft

    base = load_config(None)
    on = load_config(None, [f"{name}.cpu_bf16=true" for name in TRAINING_SECTIONS])
    for name in TRAINING_SECTIONS:
        off_dump, on_dump = getattr(base, name).artifact_dump(), getattr(on, name).artifact_dump()
        assert "cpu_bf16" not in off_dump  # the ids of runs from before the knob stay the same
        assert on_dump == off_dump | {"cpu_bf16": True}
    assert sft.artifact_config(on, 0) != sft.artifact_config(base, 0)
    args = (0, LossParams(), "sft", [10, 12], 1, None)
    assert _fingerprint(on.sft, *args) != _fingerprint(base.sft, *args)


# The craft study's settings as docs/mcts.md records its measured runs: overrides of
# configs/default.yaml. configs/craft-study.yaml must resolve to the same config, so that a run
# of the file finds those runs' artifacts (same ids) and measures the same thing.
CRAFT_STUDY_OVERRIDES = [
    "run.rounds=2",
    "envs=[{name: craft, n_train: 4000, n_val: 256, n_test: 1024, max_steps: 10,"
    " options: {depth_weights: [1, 1, 0, 0], expert_thoughts: true}}]",
    "model.tiny.hidden_size=256",
    "model.tiny.intermediate_size=768",
    "sft.lr=1e-3",
    "sft.lr_drops=1",
    "sft.max_steps=3000",
    "expert.n_tasks=2000",
    "engine.max_new_tokens=48",
    "explore.n_tasks=2000",
    "mcts.n_tasks=500",
    "mcts.tasks=unsolved",
    "iteration.data=[explore,mcts]",
    "iteration.steps=[sft]",
    "sft.with_expert=true",
    "sft.round_lr=3e-4",
    "sft.round_patience=10",
    "rft.patience=10",
    "rft.lr_drops=1",
    "rft.max_steps=3000",
    "sft.micro_batch_size=32",
    "sft_more.micro_batch_size=32",
    "rft.micro_batch_size=32",
    "rft.repeats=2",
    "baselines=[rft,sft_more]",
    "sft.restarts=1",
    "sft.restart_until=null",
]


def test_craft_study_config_is_the_measured_recipe():
    study = load_config(ROOT / "configs" / "craft-study.yaml", ["run.seed=1"]).model_dump()
    recorded = load_config(
        ROOT / "configs" / "default.yaml", [*CRAFT_STUDY_OVERRIDES, "run.seed=1"]
    ).model_dump()
    assert study["run"].pop("name") == "craft-think"
    recorded["run"].pop("name")
    assert study == recorded


# The bar recipe on the embedded default as the README records it ("Where the bar stands").
ARITH_BAR_OVERRIDES = [
    "explore.n_tasks=2000",
    "pareto.budget=2048",
    "sft.with_expert=true",
    "sft.round_lr=3e-4",
    "iteration.data=[explore,mcts]",
    "mcts.tasks=unsolved",
    "splice.revisions=false",
    "mcts.iterations=8",
    "grpo.epochs=4",
    "rft.patience=10",
    "sft.round_patience=10",
    "rft.max_steps=3000",
    "sft.micro_batch_size=32",
    "sft_more.micro_batch_size=32",
    "rft.micro_batch_size=32",
    "rft.repeats=2",
    "baselines=[rft,sft_more]",
    "iteration.steps=[grpo,sft]",
    "grpo.lr=1e-4",
    "sft.restarts=1",
    "sft.restart_until=null",
]


def test_arith_bar_config_is_the_recorded_recipe():
    bar = load_config(ROOT / "configs" / "arith-bar.yaml").model_dump()
    recorded = load_config(ROOT / "configs" / "default.yaml", ARITH_BAR_OVERRIDES).model_dump()
    assert bar["run"].pop("name") == "arith-bar"
    recorded["run"].pop("name")
    assert bar == recorded
