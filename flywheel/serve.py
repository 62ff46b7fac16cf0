"""Run the flows as Prefect deployments on this machine: a Prefect server on 127.0.0.1, a
process work pool, the deployments of ``prefect.yaml`` and a worker, until Ctrl-C.

    make serve                                  # == .venv/bin/flywheel serve, from the checkout

then, in another terminal (the server prints the same lines):

    export PREFECT_API_URL=http://127.0.0.1:4200/api
    prefect deployment run 'flywheel/default'                    # bootstrap + run.rounds rounds
    prefect deployment run 'iteration/default' -p round=1        # one round
    prefect deployment run 'stage/default' -p name=sft -p round=0 -p force=true

The server keeps its SQLite database in ``work/prefect-server`` (its own PREFECT_HOME, apart
from the in-process server ``flywheel run`` uses) with its log in ``server.log`` there; the
worker runs each flow in a subprocess from this checkout and prints its output here. Ctrl-C or
SIGTERM stops the worker, then the server. The pieces (``start_server``, ``wait_healthy``,
``ensure_pool``, ``deploy``, ``start_worker``, ``stop``) are what the integration test uses.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx
import yaml

DEFAULT_POOL = "flywheel-local"
DEPLOYMENTS = ("flywheel/default", "iteration/default", "stage/default")


class ServeError(RuntimeError):
    """Something the user can act on; the message may carry a log tail after its first line."""


def prefect_bin() -> str:
    """The ``prefect`` script of this environment (the venv need not be on PATH)."""
    script = Path(sys.executable).parent / "prefect"
    return str(script) if script.exists() else "prefect"


def prefect_env(home: Path, api_url: str | None = None, **extra: str) -> dict[str, str]:
    """The environment of every Prefect child: its own PREFECT_HOME, analytics off (Prefect 3.8
    needs it), and the API URL of our server for clients, deploy and the worker."""
    env = dict(
        os.environ, PREFECT_HOME=str(home), PREFECT_SERVER_ANALYTICS_ENABLED="false", **extra
    )
    if api_url:
        env["PREFECT_API_URL"] = api_url
    else:
        env.pop("PREFECT_API_URL", None)
    return env


def port_is_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # The server binds with SO_REUSEADDR too, so sockets in TIME_WAIT do not count as busy.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        text = path.read_text(errors="replace").rstrip().splitlines()
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(f"    {line}" for line in text[-lines:]) or "(empty log)"


def start_server(home: Path, host: str, port: int) -> subprocess.Popen:
    """``prefect server start`` in its own process group, logging to ``<home>/server.log``."""
    if not port_is_free(host, port):
        raise ServeError(
            f"port {port} on {host} is busy (another Prefect server? `lsof -i :{port}`)"
        )
    home.mkdir(parents=True, exist_ok=True)
    env = prefect_env(home)
    # The UI asks the API at PREFECT_UI_API_URL, which defaults to port 4200 whatever --port says.
    if not (env.get("PREFECT_UI_API_URL") or env.get("PREFECT_SERVER_UI_API_URL")):
        env["PREFECT_UI_API_URL"] = f"http://{host}:{port}/api"
    with open(home / "server.log", "w") as log:
        return subprocess.Popen(
            [prefect_bin(), "server", "start", "--host", host, "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def wait_healthy(proc: subprocess.Popen, api_url: str, log: Path, timeout: float = 180.0) -> float:
    """Poll ``/api/health`` until the server answers; returns the seconds it took."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise ServeError(
                f"Prefect server exited with code {proc.returncode}; last lines of {log}:\n{log_tail(log)}"
            )
        try:
            if httpx.get(f"{api_url}/health", timeout=2.0).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise ServeError(
        f"Prefect server did not answer {api_url}/health within {timeout:.0f}s; last lines of {log}:\n{log_tail(log)}"
    )


def _run(cmd: list[str], env: dict[str, str], cwd: Path, log: Path, what: str) -> None:
    with open(log, "w") as fh:
        done = subprocess.run(
            cmd, env=env, cwd=cwd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    if done.returncode != 0:
        raise ServeError(
            f"{what} failed (exit {done.returncode}); last lines of {log}:\n{log_tail(log)}"
        )


def ensure_pool(api_url: str, pool: str, home: Path) -> bool:
    """Create the process work pool unless it exists; True when it was created."""
    if httpx.get(f"{api_url}/work_pools/{pool}", timeout=10.0).status_code == 200:
        return False
    # The CLI fills in the process worker's default job template, which the REST call would not.
    cmd = [prefect_bin(), "work-pool", "create", pool, "--type", "process"]
    _run(
        cmd,
        prefect_env(home, api_url),
        Path.cwd(),
        home / "work-pool.log",
        f"creating work pool {pool!r}",
    )
    return True


def deploy(api_url: str, pool: str, home: Path, checkout: Path) -> None:
    """``prefect --no-prompt deploy --all`` from the checkout (the build step records its path);
    a pool other than prefect.yaml's goes through a copy of the file with the name replaced."""
    cmd = [prefect_bin(), "--no-prompt", "deploy", "--all"]
    spec = yaml.safe_load((checkout / "prefect.yaml").read_text())
    if any(d["work_pool"]["name"] != pool for d in spec["deployments"]):
        for d in spec["deployments"]:
            d["work_pool"] = {**d["work_pool"], "name": pool}
        copy = home / "prefect.yaml"
        copy.write_text(yaml.safe_dump(spec, sort_keys=False))
        cmd += ["--prefect-file", str(copy)]
    _run(cmd, prefect_env(home, api_url), checkout, home / "deploy.log", "prefect deploy --all")


def start_worker(
    api_url: str, pool: str, home: Path, *, run_once: bool = False, stdout: IO | None = None
) -> subprocess.Popen:
    """A process worker in its own process group; flow runs inherit its environment."""
    cmd = [prefect_bin(), "worker", "start", "--pool", pool] + (["--run-once"] if run_once else [])
    env = prefect_env(home, api_url, PREFECT_LOGGING_LEVEL="INFO")
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout else None,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def stop(proc: subprocess.Popen | None, grace: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left of it after at most ``grace``
    seconds: a stuck leader, the worker's flow runs, the server's services."""
    if proc is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def _say(msg: str) -> None:
    print(f"[serve] {msg}", flush=True)


def serve(host: str = "127.0.0.1", port: int = 4200, pool: str = DEFAULT_POOL) -> int:
    """Start server, pool, deployments and worker; block until Ctrl-C/SIGTERM; 0 on a clean stop."""
    checkout = Path.cwd()
    if not (checkout / "prefect.yaml").is_file():
        print(
            f"flywheel: error: no prefect.yaml in {checkout}; run `flywheel serve` from the checkout",
            file=sys.stderr,
        )
        return 2
    work = Path(os.environ.get("FLYWHEEL_WORK_DIR", "work")).resolve()
    home = work / "prefect-server"
    url = f"http://{host}:{port}"
    api_url = f"{url}/api"
    server = worker = None
    previous = signal.signal(signal.SIGTERM, _sigterm)
    try:
        _say(f"starting Prefect server on {url} (log: {home / 'server.log'})")
        server = start_server(home, host, port)
        took = wait_healthy(server, api_url, home / "server.log")
        _say(f"server healthy after {took:.1f}s")
        if ensure_pool(api_url, pool, home):
            _say(f"created process work pool {pool!r}")
        _say(f"deploying prefect.yaml (log: {home / 'deploy.log'})")
        t0 = time.monotonic()
        deploy(api_url, pool, home, checkout)
        _say(f"deployed {', '.join(DEPLOYMENTS)} in {time.monotonic() - t0:.1f}s")
        worker = start_worker(api_url, pool, home)
        _say(f"worker started on pool {pool!r}; its flow runs print below")
        prefect = prefect_bin()
        if Path(prefect).is_relative_to(checkout):
            prefect = os.path.relpath(prefect, checkout)
        print(
            f"\nPrefect UI: {url}\n\nIn another terminal:\n"
            f"  export PREFECT_API_URL={api_url}\n"
            f"  {prefect} deployment run 'flywheel/default'\n"
            f"  {prefect} deployment run 'iteration/default' -p round=1\n"
            f"  {prefect} deployment run 'stage/default' -p name=sft -p round=0 -p force=true\n"
            "\nCtrl-C stops the worker and the server.\n",
            flush=True,
        )
        while True:
            if server.poll() is not None:
                log = home / "server.log"
                raise ServeError(
                    f"Prefect server exited with code {server.returncode}; last lines of {log}:\n{log_tail(log)}"
                )
            if worker.poll() is not None:
                raise ServeError(
                    f"Prefect worker exited with code {worker.returncode} (its output is above)"
                )
            time.sleep(1.0)
    except KeyboardInterrupt:
        _say("stopping worker and server")
        return 0
    except ServeError as err:
        print(f"flywheel: error: {err}", file=sys.stderr)
        return 1
    except httpx.HTTPError as err:
        print(f"flywheel: error: Prefect API at {api_url}: {err}", file=sys.stderr)
        return 1
    finally:
        stop(worker)
        stop(server)
        signal.signal(signal.SIGTERM, previous)
