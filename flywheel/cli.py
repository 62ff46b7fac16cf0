"""The ``flywheel`` command.

    flywheel run [--config PATH] [--rounds N] [--force] [key.sub=value ...]
    flywheel stage NAME --round R [--force] [--config PATH] [key.sub=value ...]
    flywheel artifacts ls [--round R] [--stage S] | show ID | lineage ID
    flywheel report [--json | --html [PATH]]
    flywheel show ID [--task T] [--failed] [--source S] [--limit N]  # episodes of an artifact
    flywheel credit EXPLORE_ID [--no-greedy]  # where GRPO's signal lands (flywheel/credit.py)
    flywheel coverage EXPLORE_ID              # tasks whose solution needs a token no demonstration writes
    flywheel compare EVAL_A EVAL_B [EVAL_B ...]  # paired gain of one evaluated policy over another
    flywheel config [--fields | --reference]
    flywheel import FILE --format eto|agentgym|openai --env NAME [--split S]  # a trajectories artifact
    flywheel export ID --format eto|agentgym|openai|trl [--out FILE] [--success-only]
    flywheel serve                      # Prefect server + worker + deployments on 127.0.0.1
    flywheel serve-policy CHECKPOINT [--port 8000] [--name N]  # OpenAI-compatible policy server
    flywheel retriever serve INDEX [--host 127.0.0.1] [--port 8100]  # an index artifact over HTTP

Without ``--config`` it reads ``configs/default.yaml`` when the current folder has one (the
checkout), else the built-in defaults; ``run`` and ``stage`` first print which (``config: ...``
and the overrides), since the built-in defaults are not the demo's yaml.

Every input is checked before any work starts, and a refused command writes nothing: the
config (types, ranges, duplicate YAML keys), the command-line arguments, every env (built with
its options), ``model.base`` and DeepSpeed templates, and that ``run.work_dir`` and a local
store can be written. A refusal or a file-system failure is one line on stderr,
``flywheel: error: ...``, and exit code 2. Prefect's home (``PREFECT_HOME``, default
``<run.work_dir>/prefect``) is made only when a flow is about to run: after every check, when
Prefect's server starts. A run that never splices has no check left that needs the stages, so
its server starts before they are imported, and the imports (and MLflow's database) are done
in a thread while it starts (``_start_prefect_server``; ``benchmarks/startup.py`` times it).

``artifacts ls`` prints what it can read and one ``flywheel: warning:`` line on stderr per
artifact folder it cannot (no manifest, or a corrupted one); it exits 2 only when there were
such folders and none could be read.

SIGTERM, SIGINT and SIGHUP stop a command cleanly: the first one raises KeyboardInterrupt in
the main thread, so the flow unwinds (finished shards and train states stay for the rerun),
then every process we started (Prefect's in-process server, the sandbox's fork server) is
stopped before we exit with 128 + the signal's number. Python's default for SIGTERM and SIGHUP
ends the interpreter without running ``finally`` blocks or ``atexit`` handlers, which left
Prefect's server running with parent pid 1. Further signals while stopping are ignored, so the
clean-up (bounded: children get ``STOP_GRACE_S`` to exit, then SIGKILL) is not cut short.
Prefect's server runs in a session of its own (``_start_prefect_server``), so a signal to our
whole process group, as a terminal's Ctrl-C sends it, reaches us and not it.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:
    from flywheel.store import Unfinished

DEFAULT_CONFIG = Path("configs/default.yaml")
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_GRACE_S = 10.0  # Prefect's server and the fork server stop in well under a second
_received = 0  # the first stop signal received, 0 while none


def _interrupt(signum: int, frame: Any) -> None:
    global _received
    if _received:
        return  # already stopping: let the clean-up finish
    _received = signum
    raise KeyboardInterrupt


def _children() -> list[int]:
    """Our live child processes, from /proc (Prefect and the sandbox keep their own handles)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
        if int(ppid) == me and state != "Z":
            found.append(int(entry))
    return found


def _stop_children() -> None:
    """SIGTERM every child, SIGKILL those still running after ``STOP_GRACE_S``. Their own
    children go with them: uvicorn runs alone, the fork server kills its calls as it exits."""
    if not Path("/proc").is_dir():
        return
    for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 0.0)):
        left = _children()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = _children()
        if not left:
            return


def _drain_prefect() -> None:
    """Send Prefect's queued run logs and events while its server still runs. Left to the exit
    hooks, they would be sent after ``_stop_children`` stopped the in-process server, and the
    exit would wait on it for minutes. Bounded by ``STOP_GRACE_S``."""
    if "prefect" not in sys.modules:
        return
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for service in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            service.drain_all(timeout=STOP_GRACE_S)


def _start_prefect_server(beside: Callable[[], object] | None = None) -> None:
    """Start Prefect's temporary server (the one a flow uses when PREFECT_API_URL is unset) in
    a session of its own that ends with this process.

    ``beside``: work to do while the server starts (``flywheel run``'s ``_get_ready``: about
    18 s of imports on 2 cores before their ``.pyc`` files exist, and 9 s for MLflow's database;
    the server's first start takes about 20 s, creating its own). It runs in a thread from the
    moment the server's process is started until the server answers, and its exception is
    raised here. The process is started from this (the main) thread before that thread exists:
    ``PR_SET_PDEATHSIG`` fires when the thread that forked a child ends, and a fork copies no
    lock the other thread holds.

    Started by Prefect, it shares our process group, so a terminal's Ctrl-C or a
    ``kill -- -PGID`` stops it at the same moment as us; Prefect then spends a minute or more
    retrying to record the crash with the server that is gone, and the run ends with a
    traceback and exit 1 instead of ``flywheel: interrupted``. Out of our group only we hear
    the signal, and the server is stopped once the flow has unwound (``_stop_children``, or
    Prefect's exit hook); ``PR_SET_PDEATHSIG`` stops it if we are killed outright. Prefect's
    ``SubprocessASGIServer()`` is one instance per port: the one made here, under the default
    key, is the one its clients ask for."""
    from prefect.settings import PREFECT_API_URL

    work = _Beside(beside)
    if PREFECT_API_URL.value():
        work.join()  # a server of the user's (flywheel serve, or their own): not ours to start
        return
    import functools
    import subprocess

    from prefect.server.api.server import SubprocessASGIServer

    from flywheel.engines.server import die_with_parent

    parent = os.getpid()

    class OwnSessionServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            # Prefect's command line, started with two more Popen arguments: subprocess.Popen
            # is swapped for this one call only (the main thread, before the flow starts).
            popen = subprocess.Popen
            subprocess.Popen = functools.partial(  # type: ignore[misc,assignment]
                popen, start_new_session=True, preexec_fn=lambda: die_with_parent(parent)
            )
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen  # type: ignore[misc]
                work.start()  # the server's process exists: the work runs beside its start

    OwnSessionServer().start()  # on a stop signal shutdown waits for the work (_Beside)
    work.join()  # runs it here if no process was started (the server was already up)


def _get_ready(cfg: Any) -> None:
    """What a run does first, done while Prefect's server starts: import the stages (torch,
    transformers, DeepSpeed) and open the run's local MLflow database (about 9 s on 2 cores the
    first time, when MLflow creates its tables; the flow's tracker then finds it made)."""
    importlib.import_module("flows.flywheel")
    uri = cfg.tracking_uri()
    if cfg.tracking.enabled and uri.startswith("sqlite:///"):
        from flywheel.tracking import Tracker

        Tracker(uri, cfg.tracking.experiment)


class _Beside:
    """A callable run once in a thread (``start``), or here if never started (``join``);
    ``join`` raises what it raised.

    Not a daemon thread: when a stop signal ends the server's start, the command cleans up and
    returns while the imports may still be loading extension modules, and an interpreter that
    finalizes under such a thread aborts now and then (SIGABRT, "Fatal Python error: Aborted":
    3 of 14 stops on 2 cores as a daemon, 0 of 25 since; tests/reliability/test_signals.py,
    ``test_a_signal_while_prefect_starts_beside_the_imports_stops_the_run``). Python's shutdown
    waits for a thread that is not a daemon, so the imports finish first (seconds; nothing in
    them waits on the network or on us)."""

    def __init__(self, fn: Callable[[], object] | None) -> None:
        import threading

        self.fn = fn
        self.failed: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="beside-server-start", daemon=False)

    def _run(self) -> None:
        try:
            if self.fn is not None:
                self.fn()
        except BaseException as err:  # raised by join, in the calling thread
            self.failed.append(err)

    def start(self) -> None:
        if self.thread.ident is None:  # once: Prefect starts the process again on a port clash
            self.thread.start()

    def join(self) -> None:
        if self.thread.ident is None:
            self._run()
        else:
            self.thread.join()
        if self.failed:
            raise self.failed[0]


def _environment() -> None:
    """Defaults that must be set before Prefect, transformers or DeepSpeed are imported
    (PREFECT_HOME is set by ``_prefect_home`` once the work folder is known)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The first start of the in-process server migrates its SQLite database: slow on 2 busy cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # Progress and status lines are printed once by flywheel.progress, which also sends them to
    # the flow run's logs (its own logger, holding only Prefect's API handler, so this level
    # does not hold them back). Prefect's own logs would add a traceback in front of every
    # one-line error: PREFECT_LOGGING_LEVEL=INFO brings them back (docs/progress.md).
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    # A suite, workflow or judge named 'module:attr' is looked up from the current folder too
    # (as `python -m` does), after the installed packages so it never shadows them. Children
    # (DeepSpeed ranks, served flows) inherit it through PYTHONPATH.
    here = os.getcwd()
    if here not in sys.path:
        sys.path.append(here)
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if here not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([p for p in paths if p] + [here])
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # transformers' "Loading weights" bar (a tqdm bar per checkpoint load) would interleave with
    # our progress lines; flywheel.progress reports the long work.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _prefect_home(work_dir: str) -> Path:
    """Point Prefect's home (its SQLite database) into the work folder unless PREFECT_HOME is
    set; must run before Prefect is imported, which creates the folder."""
    os.environ.setdefault("PREFECT_HOME", str(Path(work_dir).resolve() / "prefect"))
    return Path(os.environ["PREFECT_HOME"])


def _missing(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, innermost first."""
    missing = []
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _check_writable(path: Path, key: str) -> None:
    """A one-line error unless ``path`` is (or can be made) a folder we can write to."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        what = "is" if existing == path else f"is inside {existing}, which is"
        raise ValueError(f"{key}: {path} {what} a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{key}: cannot write to {existing} (read-only or no permission)")


def _preflight(cfg: Any, *, explores: bool) -> None:
    """Everything a run reads or writes that can be checked before Prefect starts;
    ``explores``: a stage will train on the engine's rollouts."""
    from flywheel.config import ConfigError, TrainSection, rank_count
    from flywheel.engines import check_engine
    from flywheel.envs import make_suite

    for env in cfg.envs:
        make_suite(env)  # unknown env, bad import path, bad options: one-line errors
    if cfg.model.base is not None and not Path(cfg.model.base).is_dir():
        raise ConfigError(f"config error: model.base: no such folder {cfg.model.base}")
    for name in type(cfg).model_fields:
        section = getattr(cfg, name)
        if not isinstance(section, TrainSection):
            continue
        template = section.deepspeed_template()
        if template is not None and not template.is_file():
            raise ConfigError(
                f"config error: {name}.deepspeed_config: no such file {section.deepspeed_config}"
            )
        try:
            rank_count(section)  # a hostfile that is missing or names no slots
        except ConfigError as err:
            raise ConfigError(
                str(err).replace("config error: ", f"config error: {name}.", 1)
            ) from None
    _check_writable(Path(cfg.run.work_dir), "run.work_dir")
    if "://" not in cfg.run.store_root():
        _check_writable(Path(cfg.run.store_root()), "run.store")
    check_engine(cfg.engine, needs_logprobs=explores)
    if cfg.expert.data:
        from stages.expert import imported_rows

        imported_rows(cfg)  # each file exists, names a known env and parses (one line if not)


def _os_error(err: OSError) -> str:
    """An OSError as one line: what failed and on which path."""
    what = err.strerror or str(err) or type(err).__name__
    where = f": {err.filename}" if err.filename else ""
    return f"{what}{where}"


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _port(text: str) -> int:
    value = _count(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port in 1..65535, got {value}")
    return value


def _plain(text: str) -> str:
    """A stage name or artifact id: one folder name, never a path or a glob."""
    from flywheel.store import ArtifactError, check_plain

    try:
        return check_plain("", text)
    except ArtifactError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _eval_name(text: str) -> str:
    """An artifact id, or RUN:ID for one of another run's store: each part a plain name."""
    for part in text.split(":", 1):
        _plain(part)
    return text


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other error."""

    def error(self, message: str) -> NoReturn:
        print(f"flywheel: error: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(2)


def _config_path(arg: str | None) -> str | None:
    if arg:
        return arg
    return str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None


RUN_OVERRIDES = "key.sub=value config overrides (run.name=... picks another run's store)"


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="flywheel", description="Train LLM agents on their own experience.")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="bootstrap then N rounds, printing the report")
    run.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    run.add_argument(
        "--rounds", type=_count, help="rounds after the bootstrap (default: run.rounds)"
    )
    run.add_argument("--force", action="store_true", help="write new versions of every stage")
    run.add_argument("overrides", nargs="*", help="key.sub=value config overrides")

    st = sub.add_parser("stage", help="run one stage of one round (earlier stages are cache hits)")
    st.add_argument("name", type=_plain)
    st.add_argument("--round", type=_count, required=True)
    st.add_argument(
        "--force", action="store_true", help="write a new version even if nothing changed"
    )
    st.add_argument("--config")
    st.add_argument("overrides", nargs="*")

    art = sub.add_parser("artifacts", help="list and inspect artifacts")
    art.add_argument("--config")
    asub = art.add_subparsers(dest="action", required=True)
    ls = asub.add_parser("ls")
    ls.add_argument("--round", type=_count)
    ls.add_argument("--stage", type=_plain)
    ls.add_argument("overrides", nargs="*", help=RUN_OVERRIDES)
    show = asub.add_parser("show")
    show.add_argument("id", type=_plain)
    show.add_argument("--rows", type=_count, default=0, help="also print the first N rows")
    show.add_argument("overrides", nargs="*", help=RUN_OVERRIDES)
    lin = asub.add_parser("lineage")
    lin.add_argument("id", type=_plain)
    lin.add_argument("overrides", nargs="*", help=RUN_OVERRIDES)

    rep = sub.add_parser("report", help="held-out metrics of every evaluated policy")
    fmt = rep.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument(
        "--html",
        nargs="?",
        const="",
        metavar="PATH",
        help="write the HTML report into the folder PATH (default: <run.work_dir>/report/<run.name>) "
        "and print the path of its index.html; overrides go before --html",
    )
    rep.add_argument("--config")
    rep.add_argument("overrides", nargs="*", help=RUN_OVERRIDES)

    sh = sub.add_parser(
        "show", help="print the episodes of a trajectories, eval, groups or pairs artifact"
    )
    sh.add_argument("id", type=_plain)
    sh.add_argument("--task", help="only this task id")
    sh.add_argument("--failed", action="store_true", help="only episodes that did not succeed")
    sh.add_argument("--source", help="only this source: expert, explore, mcts, revision, import")
    sh.add_argument("--limit", type=_count, default=10, help="at most N episodes (0: all)")
    sh.add_argument("--config")
    sh.add_argument("overrides", nargs="*", help=RUN_OVERRIDES)

    cr = sub.add_parser(
        "credit",
        help="where GRPO's signal lands in an explore artifact: departures from the oracle, "
        "the weight that cancels inside groups, slips greedy decoding would not make",
    )
    cr.add_argument("id", type=_plain, help="an explore artifact")
    cr.add_argument("--no-greedy", action="store_true", help="skip the policy's greedy check")
    cr.add_argument("--config")
    cr.add_argument("overrides", nargs="*")

    cp = sub.add_parser(
        "compare",
        help="eval artifacts (any rounds, baselines or reruns; RUN:ID for another run's): "
        "success of each and the paired gain of the first over the second (over the mean of "
        "the others, when several follow: repeats of one baseline)",
    )
    cp.add_argument("a", type=_eval_name, help="an eval artifact (RUN:ID: one of run RUN's store)")
    # The ids and the overrides after them arrive together (argparse gives every positional
    # to b): main splits them at the first key=value.
    cp.add_argument("b", nargs="+", help="the eval artifact(s) to compare against, averaged")
    cp.add_argument(
        "--by-difficulty",
        action="store_true",
        help="also each difficulty level's success and paired gain (arith: operations)",
    )
    cp.add_argument("--config")
    cp.add_argument("overrides", nargs="*")

    cv = sub.add_parser(
        "coverage",
        help="what imitating its own successes cannot teach: explored tasks grouped by how often "
        "the demonstrations write the rarest token of the oracle's solution",
    )
    cv.add_argument("id", type=_plain, help="an explore artifact")
    cv.add_argument("--config")
    cv.add_argument("overrides", nargs="*")

    cfg = sub.add_parser("config", help="print the resolved config")
    cfg.add_argument("--config")
    cfg.add_argument("--fields", action="store_true", help="list every key with its help text")
    cfg.add_argument(
        "--reference", action="store_true", help="print the config reference (docs/config.md)"
    )
    cfg.add_argument("overrides", nargs="*")

    # Literal choices (flywheel.interchange's IMPORT_FORMATS / EXPORT_FORMATS): parsing stays
    # free of pyarrow imports.
    imp = sub.add_parser(
        "import", help="a file of ETO, AgentGym or OpenAI-messages trajectories as an artifact"
    )
    imp.add_argument("file", help="the file to read (docs/data.md shows each format)")
    imp.add_argument("--format", required=True, choices=("eto", "agentgym", "openai"))
    imp.add_argument("--env", required=True, type=_plain, help="env name of the trajectories")
    imp.add_argument(
        "--split", default="train", choices=("train", "val", "test"),
        help="split of the records that name none (default: train)",
    )  # fmt: skip
    imp.add_argument("--config", help="YAML config whose store receives the artifact")
    imp.add_argument("overrides", nargs="*", help="key.sub=value config overrides")

    exp = sub.add_parser(
        "export",
        help="a trajectories artifact as SFT data, or a pairs artifact as preference pairs",
    )
    exp.add_argument("id", type=_plain)
    exp.add_argument(
        "--format", required=True, choices=("eto", "agentgym", "openai", "trl"),
        help="eto, agentgym, openai: trajectories; trl, eto: pairs",
    )  # fmt: skip
    exp.add_argument("--out", help="file to write (default: stdout)")
    exp.add_argument(
        "--success-only", action="store_true", help="only the trajectories that succeeded"
    )
    exp.add_argument("--config")
    exp.add_argument("overrides", nargs="*", help="key.sub=value config overrides")

    srv = sub.add_parser(
        "serve", help="start a Prefect server and worker on 127.0.0.1 and deploy the flows"
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=_port, default=4200)
    srv.add_argument(
        "--pool", default="flywheel-local", help="process work pool to create and serve"
    )

    sp = sub.add_parser(
        "serve-policy", help="serve a policy checkpoint over an OpenAI-compatible HTTP API"
    )
    sp.add_argument("checkpoint", help="a folder holding a HF model, or a checkpoint artifact id")
    sp.add_argument("--host", default="127.0.0.1")
    sp.add_argument("--port", type=_port, default=8000)
    sp.add_argument(
        "--name", help="the model name clients send (default: artifact id or folder name)"
    )
    sp.add_argument("--batch-size", type=_count, default=64, help="rows per engine call at most")
    sp.add_argument(
        "--batch-wait-ms", type=float, default=5.0,
        help="how long the first request waits for others to share its engine call",
    )  # fmt: skip
    sp.add_argument("--config", help="YAML config whose store holds the artifact")
    sp.add_argument("overrides", nargs="*", help="key.sub=value config overrides")

    ret = sub.add_parser("retriever", help="search an index artifact over HTTP")
    rsub = ret.add_subparsers(dest="action", required=True)
    rs = rsub.add_parser("serve", help="serve POST /search and GET /health (flywheel/retrieval.py)")
    rs.add_argument("index", help="an index artifact id (flywheel stage index), or its folder")
    rs.add_argument("--host", default="127.0.0.1")
    rs.add_argument("--port", type=_port, default=8100)
    rs.add_argument("--config", help="YAML config whose store holds the artifact")
    rs.add_argument("overrides", nargs="*", help="key.sub=value config overrides")
    return p


def _parse(argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; overrides may also follow options (``stage grpo --round 1 a.b=c``), which
    plain argparse rejects once the positional list has been matched before the option."""
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") for e in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def _store(config: str | None, overrides: list[str]):
    from flywheel.config import load_config
    from flywheel.store import Store

    cfg = load_config(_config_path(config), overrides)
    return Store(cfg.run.store_root(), cfg.run.name)


def _took(manifest: dict) -> str:
    """``  took 1:04:21`` for ``artifacts ls``; ``(resumed)`` when an interrupted run's shards or
    train state were taken over, whose time is not counted. Manifests written before stages
    were timed have no ``seconds``: nothing."""
    if "seconds" not in manifest:
        return ""
    from flywheel.progress import duration

    return f"  took {duration(manifest['seconds'])}" + (
        " (resumed)" if manifest.get("resumed") else ""
    )


def _progress(u: Unfinished) -> str:
    """What an unfinished write holds so far, for ``artifacts ls``: the train state a training
    stage resumes from, or the shards a rollout stage wrote, when it last wrote, and what a rerun
    of its stage would keep."""
    if u.train_step is not None:
        done, rerun = f"train state at step {u.train_step}", "a rerun resumes from it"
    elif u.shards:
        plural = "s" if u.shards > 1 else ""
        done, rerun = (
            f"{u.shards} shard{plural} written",
            f"a rerun keeps {'them' if plural else 'it'}",
        )
    else:
        done, rerun = "no train state or shard yet", "a rerun starts it over"
    when = f", last write {u.modified:%Y-%m-%d %H:%M} UTC" if u.modified else ""
    return f"{done}{when} (running, or stopped: {rerun})"


def _print_lineage(node: dict, depth: int = 0) -> None:
    metrics = ", ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
        for k, v in list(node["summary"].items())[:4]
    )
    print(f"{'  ' * depth}{node['id']}  [{node['kind']}, round {node['round']}]  {metrics}")
    for child in node["inputs"]:
        _print_lineage(child, depth + 1)


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parse(argv)  # writes nothing: --help and usage errors end here
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 0
    _environment()
    from data_contracts import SchemaError
    from flywheel.config import ConfigError
    from flywheel.store import ArtifactError

    global _received
    _received = 0
    previous = {sig: signal.signal(sig, _interrupt) for sig in STOP_SIGNALS}
    try:
        return _dispatch(args)
    except BaseException as err:
        # A stop signal may surface as another exception once Prefect has handled the
        # KeyboardInterrupt (a crashed flow run): it is still the interruption.
        if _received or isinstance(err, KeyboardInterrupt):
            _received = _received or signal.SIGINT
            name = signal.Signals(_received).name
            print(
                f"flywheel: interrupted ({name}); rerun to resume (finished shards are kept)",
                file=sys.stderr,
            )
            return 128 + _received
        if isinstance(err, (ConfigError, ArtifactError, SchemaError, ValueError)):
            msg = str(err).splitlines()[0] if str(err) else type(err).__name__
            print(f"flywheel: error: {msg}", file=sys.stderr)
            return 2
        if isinstance(err, OSError):  # read-only or full disk, a file where a folder should be
            print(f"flywheel: error: {_os_error(err)}", file=sys.stderr)
            return 2
        raise
    finally:
        if _received:
            _drain_prefect()
            _stop_children()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _dispatch(args: argparse.Namespace) -> int:
    if args.command in ("run", "stage"):
        from flywheel.config import load_config

        # A bad input is a one-line error here; inside the flow Prefect would first log a
        # traceback (and start its server, ~15 s) before the error reached us.
        cfg = load_config(_config_path(args.config), args.overrides)
        rounds = cfg.run.rounds if getattr(args, "rounds", None) is None else args.rounds
        explores = rounds > 0 if args.command == "run" else args.name in ("explore", "mcts")
        _preflight(cfg, explores=explores)
        home = _prefect_home(cfg.run.work_dir)
        new = _missing(home)
        # A run that never splices has no check left that needs the stages (check_run checks
        # splices only), so Prefect's server starts now, beside the stages' imports (about 18 s
        # on 2 cores before their .pyc files exist) and MLflow's database (_get_ready). A stage
        # or a splicing run is checked first.
        from flows.walk import splices

        early = args.command == "run" and not splices(cfg, rounds)
        try:
            # Prefect's import wants its home to exist (it warns otherwise)
            home.mkdir(parents=True, exist_ok=True)
            if early:
                _start_prefect_server(beside=lambda: _get_ready(cfg))
            from flows.flywheel import check_plan, check_run

            if args.command == "stage":
                check_plan(cfg, args.name, args.round)
                check_run(cfg, max(args.round, 0), stop_at=(args.name, args.round))
            else:
                check_run(cfg, rounds)
        except BaseException:
            for folder in new:  # a refused command leaves nothing behind
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
            raise
        if not early:
            _start_prefect_server()
    if args.command == "run":
        from flows.flywheel import flywheel_flow

        flywheel_flow(
            config=_config_path(args.config),
            overrides=args.overrides,
            rounds=args.rounds,
            force=args.force,
        )
        return 0
    if args.command == "stage":
        from flows.flywheel import stage_flow

        ref_id = stage_flow(
            name=args.name,
            round=args.round,
            config=_config_path(args.config),
            overrides=args.overrides,
            force=args.force,
        )
        print(ref_id)
        return 0
    if args.command == "artifacts":
        store = _store(args.config, args.overrides)
        if args.action == "ls":
            refs, problems = store.scan(round=args.round, stage=args.stage)
            for ref in refs:
                print(
                    f"round {ref.round}  {ref.stage:<9} {ref.kind:<12} {ref.id:<28} rows={ref.manifest.get('rows')}  {ref.manifest.get('created')}{_took(ref.manifest)}"
                )
            for u in store.unfinished(round=args.round, stage=args.stage):
                print(f"round {u.round}  {u.stage:<9} {'unfinished':<12} {u.id:<28} {_progress(u)}")
            failed = bool(problems) and not refs
            for problem in problems:
                print(f"flywheel: {'error' if failed else 'warning'}: {problem}", file=sys.stderr)
            return 2 if failed else 0
        if args.action == "show":
            ref = store.get(args.id)
            print(json.dumps(ref.manifest, indent=2, default=str))
            if args.rows:
                print(store.read(ref).slice(0, args.rows).to_pandas().to_string())
            return 0
        _print_lineage(store.lineage(args.id))
        return 0
    if args.command == "report":
        from flywheel.report import collect, format_table, unfinished

        if args.html is not None:
            from flywheel.config import load_config
            from flywheel.html_report import write_html
            from flywheel.store import Store

            cfg = load_config(_config_path(args.config), args.overrides)
            out = Path(args.html or Path(cfg.run.work_dir) / "report" / cfg.run.name)
            print(write_html(Store(cfg.run.store_root(), cfg.run.name), out))
            return 0
        store = _store(args.config, args.overrides)
        rows = collect(store)
        note = unfinished(store)
        if note:  # on stderr, so `report --json` stays one JSON document
            print(note, file=sys.stderr)
        print(json.dumps(rows, indent=2) if args.json else format_table(rows))
        return 0
    if args.command == "show":
        from flywheel.show import render, use_color

        text = render(
            _store(args.config, args.overrides),
            args.id,
            task=args.task,
            failed=args.failed,
            source=args.source,
            limit=args.limit,
            color=use_color(sys.stdout),
        )
        try:
            print(text, end="", flush=True)
        except BrokenPipeError:  # `flywheel show ... | less` quit early: not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    if args.command == "credit":
        from flywheel.config import load_config
        from flywheel.credit import credit_report
        from flywheel.store import Store

        cfg = load_config(_config_path(args.config), args.overrides)
        store = Store(cfg.run.store_root(), cfg.run.name)
        print(credit_report(cfg, store, args.id, greedy=not args.no_greedy))
        return 0
    if args.command == "compare":
        from flywheel.report import compare

        # Store and Store.get check that each part of an id (RUN:ID) is a plain name.
        ids = [x for x in args.b if "=" not in x]
        overrides = [x for x in args.b if "=" in x] + args.overrides
        print(
            compare(_store(args.config, overrides), args.a, *ids, by_difficulty=args.by_difficulty)
        )
        return 0
    if args.command == "coverage":
        from flywheel.config import load_config
        from flywheel.coverage import coverage_report
        from flywheel.store import Store

        cfg = load_config(_config_path(args.config), args.overrides)
        store = Store(cfg.run.store_root(), cfg.run.name)
        print(coverage_report(cfg, store, args.id))
        return 0
    if args.command == "config":
        from flywheel.config import config_reference, dump_config, field_help, load_config

        if args.reference:
            print(config_reference(), end="")
        elif args.fields:
            for key, text in field_help():
                print(f"{key:<40} {text}")
        else:
            print(dump_config(load_config(_config_path(args.config), args.overrides)), end="")
        return 0
    if args.command in ("import", "export"):
        return _interchange(args)
    if args.command == "serve":
        from flywheel.serve import serve

        work = os.environ.get("FLYWHEEL_WORK_DIR", "work")
        _prefect_home(work).mkdir(parents=True, exist_ok=True)

        return serve(host=args.host, port=args.port, pool=args.pool)
    if args.command == "serve-policy":
        from flywheel.config import load_config
        from flywheel.serve_policy import resolve_checkpoint, serve_policy

        cfg = load_config(_config_path(args.config), args.overrides)
        folder, name = resolve_checkpoint(args.checkpoint, cfg)
        return serve_policy(
            folder,
            name=name if args.name is None else args.name,
            host=args.host,
            port=args.port,
            batch_size=args.batch_size,
            batch_wait_ms=args.batch_wait_ms,
        )
    if args.command == "retriever":
        from flywheel.config import load_config
        from flywheel.retrieval import resolve_index, serve_retriever

        cfg = load_config(_config_path(args.config), args.overrides)
        index_dir, index_name = resolve_index(args.index, cfg)
        return serve_retriever(index_dir, name=index_name, host=args.host, port=args.port)
    raise AssertionError(args.command)


def _interchange(args: argparse.Namespace) -> int:
    """``flywheel import`` and ``flywheel export`` (flywheel/interchange.py)."""
    from flywheel.config import load_config
    from flywheel.interchange import export_artifact, import_file, write_atomic
    from flywheel.store import Store

    cfg = load_config(_config_path(args.config), args.overrides)
    store = Store(cfg.run.store_root(), cfg.run.name)
    if args.command == "import":
        ref = import_file(store, args.file, args.format, env=args.env, split=args.split)
        print(f"{ref.id}  {ref.manifest.get('rows')} trajectories")
        return 0
    result = export_artifact(store, args.id, args.format, success_only=args.success_only)
    if result.warning:
        print(f"flywheel: warning: {result.warning}", file=sys.stderr)
    if args.out:
        write_atomic(Path(args.out), result.text)
        print(f"{args.out}: {result.records} records ({args.format})")
        return 0
    try:
        print(result.text, end="", flush=True)
    except BrokenPipeError:  # `flywheel export ... | head` quit early: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


if __name__ == "__main__":
    sys.exit(main())
