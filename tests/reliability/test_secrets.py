"""Secrets: nothing from the environment reaches MLflow (params, tags, the logged manifests) or
the artifacts' manifests; a password in a URL is masked before it is logged; servers bind
127.0.0.1 unless told otherwise.

    .venv/bin/python -m pytest tests/reliability/test_secrets.py
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

import flywheel.serve
from flywheel.cli import _parser
from flywheel.tracking import Tracker, _environ, redact
from tests.conftest import write_tiny_yaml

ROOT = Path(__file__).resolve().parents[2]
FLYWHEEL = str(Path(sys.executable).parent / "flywheel")
SECRET_NAMES = (
    "HF_TOKEN", "AWS_SECRET_ACCESS_KEY", "MLFLOW_TRACKING_PASSWORD", "OPENAI_API_KEY",
    "FLYWHEEL_PROBE",  # a name that does not look secret: still never read into a param
)  # fmt: skip


def loopback_only(listening: list[str]) -> bool:
    return all(a.startswith(("0100007F:", "00000000000000000000000001000000:")) for a in listening)


def listening_sockets(pid: int | str = "self") -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) of the TCP sockets ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.append(fields[1])
    return found


@pytest.mark.slow
def test_environment_secrets_reach_neither_mlflow_nor_manifests(tmp_path):
    """`flywheel stage expert` (tasks and expert: 4 artifacts, the run's config as params) with
    tracking on and secrets in its environment: their values are in no byte of the MLflow
    database, its artifacts, or anything written under the store."""
    values = {name: f"s3cr3t-{secrets.token_hex(12)}" for name in SECRET_NAMES}
    config = write_tiny_yaml(tmp_path, "tracking.enabled=true")
    done = subprocess.run(
        [FLYWHEEL, "stage", "expert", "--round", "0", "--config", str(config)],
        cwd=tmp_path,  # MLflow's default artifact folder (./mlruns) lands under tmp_path too
        env={**os.environ, **values},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    written = [p for p in tmp_path.rglob("*") if p.is_file() and "prefect" not in p.parts]
    assert any(p.name == "mlflow.db" for p in written)
    assert sum(p.name == "manifest.json" for p in written) >= 4
    for path in written:
        data = path.read_bytes()
        for name, value in values.items():
            assert value.encode() not in data, f"{name}'s value is in {path}"


def test_url_passwords_and_secret_variables_are_masked_in_params_and_tags(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_API_TOKEN", "tok-0123456789")
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "secrets")
    run = tracker.start("run", tags={"store": "s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/flywheel"})
    tracker.log_params(
        run,
        {
            "run": {"store": "s3://AKIAEXAMPLE:wJalrXUtnFEMI@bucket/flywheel"},
            "tracking": {"uri": "https://alice:hunter22@mlflow.example/"},
            "note": "header Bearer tok-0123456789",
            "plain": "https://mlflow.example/api",
        },
    )
    assert tracker.client is not None
    data = tracker.client.get_run(run).data
    assert data.params["run.store"] == "s3://AKIAEXAMPLE:***@bucket/flywheel"
    assert data.params["tracking.uri"] == "https://alice:***@mlflow.example/"
    assert data.params["note"] == "header Bearer ***"
    assert data.params["plain"] == "https://mlflow.example/api"
    assert data.tags["store"] == "s3://AKIAEXAMPLE:***@bucket/flywheel"
    assert redact("python 3.11, 4 steps") == "python 3.11, 4 steps"


def test_servers_bind_loopback_unless_told(monkeypatch, tmp_path):
    assert _parser().parse_args(["serve"]).host == "127.0.0.1"
    started = []

    class FakePopen:
        def __init__(self, argv, **kw):
            started.append(argv)

    monkeypatch.setattr(flywheel.serve.subprocess, "Popen", FakePopen)
    flywheel.serve.start_server(tmp_path, "127.0.0.1", 1)
    argv = started[0]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "--host 127.0.0.1" in (ROOT / "Makefile").read_text()  # make ui


CHILD = """
import os
from flywheel.training.loop import init_distributed
from tests.reliability.test_secrets import listening_sockets
init_distributed()
print(" ".join(listening_sockets()))
"""


def test_training_listens_on_loopback_only():
    dist = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist}
    done = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found = done.stdout.strip().splitlines()[-1].split()  # DeepSpeed may print before it
    assert found and loopback_only(found), found


class _VanishingEnviron(Mapping[str, str]):
    """An environment from which another thread deletes a variable while the first copy reads
    it: its first listing names a key that is gone by the time its value is read."""

    def __init__(self, data: dict[str, str]) -> None:
        self.data, self.listings = data, 0

    def __iter__(self) -> Iterator[str]:
        self.listings += 1
        return iter([*self.data, "_GONE_MID_COPY"] if self.listings == 1 else list(self.data))

    def __getitem__(self, name: str) -> str:
        return self.data[name]

    def __len__(self) -> int:
        return len(self.data)


def test_the_environment_is_copied_again_when_a_variable_vanishes_mid_copy():
    # MLflow's telemetry thread deletes _MLFLOW_TELEMETRY_SESSION_ID during a run; a KeyError
    # from reading os.environ once stopped a run at its first logged stage (redact reads it).
    environ = _VanishingEnviron({"HF_TOKEN": "hf_0123456789", "HOME": "/home/user"})
    assert _environ(environ) == {"HF_TOKEN": "hf_0123456789", "HOME": "/home/user"}
    assert environ.listings == 2
