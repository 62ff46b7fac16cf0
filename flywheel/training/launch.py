"""Run a training stage's `train()` on one rank in this process, or on several ranks through the
DeepSpeed launcher.

    result = run_training(model, examples, model_dir=folder, loss="sft", cfg=section, out_dir=out,
                          validation=functools.partial(make_validate, ...))

With `cfg.world_size == 1` and no `cfg.hostfile` this is `loop.train(...)` here, in this process.
Otherwise it writes a launch folder `out_dir/_launch` (spec.json: the loss and its numbers, the
training section, the starting model folder, out_dir, seed; examples.pkl; validation.pkl: the
pickled `validation` factory) and runs

    deepspeed --num_accelerators N --master_port P --no_local_rank \\
        --module flywheel.training.launch out_dir/_launch

(`--hostfile F` instead of `--num_accelerators N` for several machines). Every rank loads the
model from `model_dir` in float32, as the stages' `load_policy` does, calls the factory to build
its validation callback, and trains; rank 0 writes the TrainResult to result.json, which
`run_training` reads back. The launcher's output streams to this process's stdout; a failure is a
one-line RuntimeError naming the log file. On a CPU box the ranks get DS_ACCELERATOR=cpu and an
equal share of the cores (OMP_NUM_THREADS).

The ranks share each step's `grad_accum` micro-batches (`flywheel.training.loop`), so the rank
count changes the speed, not the result. With a hostfile, every machine needs the same checkout
and virtual environment at the same path, and the store and work folder on a file system all of
them see at the same path (rank 0 writes the model, every rank its train-state partition).

Tests: `pytest tests/flywheel/training/test_launch.py`.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import torch

import flywheel.config
from flywheel.config import TrainSection, rank_count
from flywheel.progress import say
from flywheel.training import data
from flywheel.training.loop import LossParams, TrainResult, _free_port, train

LAUNCH_DIR = "_launch"  # inside out_dir; removed once the result is read back
SPEC, EXAMPLES, VALIDATION, RESULT, LOG = (
    "spec.json",
    "examples.pkl",
    "validation.pkl",
    "result.json",
    "launcher.log",
)
MODULE = "flywheel.training.launch"

Validate = Callable[[torch.nn.Module], dict[str, float]]
# Builds the validate callback (None: no validation). It is pickled for the ranks, so it must be
# a module-level function or a functools.partial of one over picklable arguments.
ValidationFactory = Callable[[], Validate | None]


def run_training(
    model: torch.nn.Module,
    examples: Sequence[data.Example],
    *,
    model_dir: str | Path,
    loss: Literal["sft", "dpo", "grpo"],
    cfg: TrainSection,
    out_dir: str | Path,
    seed: int = 0,
    params: LossParams | None = None,
    reference: bool = False,
    log: Callable[[dict], None] | None = None,
    validation: ValidationFactory | None = None,
    max_tokens: int | None = None,
    log_every: int = 0,
    start_validation: dict[str, float] | None = None,
    label: str | None = None,
) -> TrainResult:
    """`loop.train` on the ranks `cfg` asks for; the trained model is saved in `out_dir`.

    `model_dir` holds `model`'s weights (the checkpoint it was loaded from): the ranks of a
    multi-rank run load it there, and leave `model` itself untrained. `reference` trains against a
    frozen copy of the starting policy. `log` gets every step's record, after the run when it
    ran on several ranks."""
    ranks = rank_count(cfg)
    validate = validation() if validation is not None else None  # its errors surface here
    if ranks == 1:
        ref_model = copy.deepcopy(model) if reference else None
        return train(
            model, examples, loss=loss, cfg=cfg, out_dir=out_dir, seed=seed, params=params,
            ref_model=ref_model, log=log, validate=validate, max_tokens=max_tokens,
            log_every=log_every, start_validation=start_validation, label=label,
        )  # fmt: skip
    folder = write_spec(
        Path(out_dir) / LAUNCH_DIR, examples, model_dir=model_dir, loss=loss, cfg=cfg,
        out_dir=out_dir, seed=seed, params=params or LossParams(), reference=reference,
        validation=validation if validate is not None else None, max_tokens=max_tokens,
        log_every=log_every, start_validation=start_validation, label=label,
    )  # fmt: skip
    # The ranks load their own copies: leave the accelerators to them.
    model.to("cpu")
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    command = launch_command(cfg, folder, _free_port())
    say(f"[train {label or loss}] {ranks} ranks: {' '.join(command)}")
    _run_launcher(command, _launcher_env(ranks), folder / LOG, ranks)
    result_path = folder / RESULT
    if not result_path.is_file():
        raise RuntimeError(f"training on {ranks} ranks wrote no {result_path}; see {folder / LOG}")
    result = TrainResult(**json.loads(result_path.read_text()))
    shutil.rmtree(folder, ignore_errors=True)
    if log is not None:
        for record in result.history:
            if "loss" in record:  # not the validation before the first step
                log(record)
    return result


def launch_command(cfg: TrainSection, folder: Path, port: int) -> list[str]:
    """The deepspeed launcher command that trains the launch folder `folder` on cfg's ranks."""
    launcher = Path(sys.executable).parent / "deepspeed"
    where = (
        ["--hostfile", str(Path(cfg.hostfile).resolve())]
        if cfg.hostfile is not None
        else ["--num_accelerators", str(cfg.world_size)]
    )
    return [
        str(launcher), *where, "--master_port", str(port), "--no_local_rank",
        "--module", MODULE, str(folder.resolve()),
    ]  # fmt: skip


def write_spec(
    folder: Path,
    examples: Sequence[data.Example],
    *,
    model_dir: str | Path,
    loss: str,
    cfg: TrainSection,
    out_dir: str | Path,
    seed: int,
    params: LossParams,
    reference: bool,
    validation: ValidationFactory | None,
    max_tokens: int | None,
    log_every: int,
    start_validation: dict[str, float] | None = None,
    label: str | None = None,
) -> Path:
    """Write everything the ranks need into `folder` (made empty first); return it."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if validation is not None:
        try:
            blob = pickle.dumps(validation)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            raise ValueError(
                f"validation cannot be sent to the training ranks ({err}); "
                "set val_every: 0 or world_size: 1"
            ) from None
        (folder / VALIDATION).write_bytes(blob)
    with open(folder / EXAMPLES, "wb") as fh:
        pickle.dump(list(examples), fh, protocol=pickle.HIGHEST_PROTOCOL)
    spec = {
        "loss": loss,
        "seed": seed,
        "params": dataclasses.asdict(params),
        "section": {"class": type(cfg).__name__, "fields": cfg.model_dump()},
        "model_dir": str(Path(model_dir).resolve()),
        "out_dir": str(Path(out_dir).resolve()),
        "reference": reference,
        "validation": VALIDATION if validation is not None else None,
        "max_tokens": max_tokens,
        "log_every": log_every,
        "start_validation": start_validation,
        "label": label,
    }
    (folder / SPEC).write_text(json.dumps(spec, indent=1))
    return folder


def _launcher_env(ranks: int) -> dict[str, str]:
    from deepspeed.accelerator import get_accelerator

    env = dict(os.environ)
    if get_accelerator().device_name() == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        # Every rank would otherwise start a thread per core, and the ranks fight over them.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    return env


def _run_launcher(command: list[str], env: dict[str, str], log_path: Path, ranks: int) -> None:
    """Run the launcher, streaming its output to stdout and `log_path`; one line on failure."""
    tail: collections.deque[str] = collections.deque(maxlen=200)
    # Its own session, so an interrupted stage can stop the launcher and every rank together.
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        with open(log_path, "w") as log:
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
                tail.append(line.rstrip())
        code = proc.wait()
    finally:
        if proc.poll() is None:
            _stop(proc)
    if code != 0:
        raise RuntimeError(
            f"training on {ranks} ranks failed (deepspeed exit {code}): {_error_line(tail)}; "
            f"full output in {log_path}"
        )


def _error_line(lines: Sequence[str]) -> str:
    """The last line that names an exception, else the last line."""
    for line in reversed(lines):
        if re.search(r"\b\w*(Error|Exception)\b.*:", line):
            return line.strip()
    return lines[-1].strip() if lines else "no output"


def _stop(proc: subprocess.Popen[str]) -> None:
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def main(argv: list[str] | None = None) -> None:
    """One rank: train what the launch folder argv[0] describes; rank 0 writes result.json."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    folder = Path((argv if argv is not None else sys.argv[1:])[0])
    spec = json.loads((folder / SPEC).read_text())
    section_class = getattr(flywheel.config, spec["section"]["class"])
    cfg = section_class.model_validate(spec["section"]["fields"])
    with open(folder / EXAMPLES, "rb") as fh:
        examples = pickle.load(fh)  # noqa: S301 (written by run_training for these ranks)
    validate = None
    if spec["validation"] is not None:
        factory = pickle.loads((folder / spec["validation"]).read_bytes())  # noqa: S301
        validate = factory()
    model = AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype="float32")
    ref_model = (
        AutoModelForCausalLM.from_pretrained(spec["model_dir"], dtype="float32")
        if spec["reference"]
        else None
    )
    result = train(
        model, examples, loss=spec["loss"], cfg=cfg, out_dir=spec["out_dir"], seed=spec["seed"],
        params=LossParams(**spec["params"]), ref_model=ref_model, validate=validate,
        max_tokens=spec["max_tokens"], log_every=spec["log_every"],
        start_validation=spec.get("start_validation"), label=spec.get("label"),
    )  # fmt: skip
    if dist.get_rank() == 0:
        tmp = folder / (RESULT + ".tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(result)))
        os.replace(tmp, folder / RESULT)  # run_training never reads half a result
    # Leave the group together and on purpose: a rank that exits with the gloo group still up
    # can abort in its communication threads' destructors ("terminate called without an active
    # exception", exit -6) while the other rank still talks to it, failing a finished run.
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
