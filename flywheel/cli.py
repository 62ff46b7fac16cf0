"""The ``flywheel`` command.

    flywheel run [--config PATH] [--rounds N] [--force] [key.sub=value ...]
    flywheel stage NAME --round R [--force] [--config PATH] [key.sub=value ...]
    flywheel artifacts ls [--round R] [--stage S] | show ID | lineage ID
    flywheel report [--json]
    flywheel config [--fields]
    flywheel serve                      # Prefect server + worker + deployments on 127.0.0.1

Without ``--config`` it reads ``configs/default.yaml`` when the current folder has one (the
checkout), else the built-in defaults. Errors are one line on stderr and a non-zero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

DEFAULT_CONFIG = Path("configs/default.yaml")


def _environment() -> None:
    """Defaults that must be set before Prefect, transformers or DeepSpeed are imported."""
    work = Path(os.environ.get("FLYWHEEL_WORK_DIR", "work")).resolve()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("PREFECT_HOME", str(work / "prefect"))
    # Prefect's SQLite file lives here.
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The first start of the in-process server migrates its SQLite database: slow on 2 busy cores.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    # Progress is printed by the flows themselves; Prefect's own logs would add a traceback in
    # front of every one-line error. PREFECT_LOGGING_LEVEL=INFO brings them back.
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
    os.environ.setdefault("PREFECT_LOGGING_TO_API_WHEN_MISSING_FLOW", "ignore")
    os.environ.setdefault("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _config_path(arg: str | None) -> str | None:
    if arg:
        return arg
    return str(DEFAULT_CONFIG) if DEFAULT_CONFIG.is_file() else None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flywheel", description="Train LLM agents on their own experience."
    )
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="bootstrap then N rounds, printing the report")
    run.add_argument("--config", help="YAML config (default: configs/default.yaml)")
    run.add_argument("--rounds", type=int, help="rounds after the bootstrap (default: run.rounds)")
    run.add_argument("--force", action="store_true", help="write new versions of every stage")
    run.add_argument("overrides", nargs="*", help="key.sub=value config overrides")

    st = sub.add_parser("stage", help="run one stage of one round (earlier stages are cache hits)")
    st.add_argument("name")
    st.add_argument("--round", type=int, required=True)
    st.add_argument(
        "--force", action="store_true", help="write a new version even if nothing changed"
    )
    st.add_argument("--config")
    st.add_argument("overrides", nargs="*")

    art = sub.add_parser("artifacts", help="list and inspect artifacts")
    art.add_argument("--config")
    asub = art.add_subparsers(dest="action", required=True)
    ls = asub.add_parser("ls")
    ls.add_argument("--round", type=int)
    ls.add_argument("--stage")
    show = asub.add_parser("show")
    show.add_argument("id")
    show.add_argument("--rows", type=int, default=0, help="also print the first N rows")
    lin = asub.add_parser("lineage")
    lin.add_argument("id")

    rep = sub.add_parser("report", help="held-out metrics of every evaluated policy")
    rep.add_argument("--json", action="store_true")
    rep.add_argument("--config")

    cfg = sub.add_parser("config", help="print the resolved config")
    cfg.add_argument("--config")
    cfg.add_argument("--fields", action="store_true", help="list every key with its help text")
    cfg.add_argument("overrides", nargs="*")

    srv = sub.add_parser(
        "serve", help="start a Prefect server and worker on 127.0.0.1 and deploy the flows"
    )
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=4200)
    srv.add_argument(
        "--pool", default="flywheel-local", help="process work pool to create and serve"
    )
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


def _store(config: str | None):
    from flywheel.config import load_config
    from flywheel.store import Store

    cfg = load_config(_config_path(config))
    return Store(cfg.run.store_root(), cfg.run.name)


def _print_lineage(node: dict, depth: int = 0) -> None:
    metrics = ", ".join(
        f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
        for k, v in list(node["summary"].items())[:4]
    )
    print(f"{'  ' * depth}{node['id']}  [{node['kind']}, round {node['round']}]  {metrics}")
    for child in node["inputs"]:
        _print_lineage(child, depth + 1)


def main(argv: list[str] | None = None) -> int:
    _environment()
    args = _parse(argv)
    from data_contracts import SchemaError
    from flywheel.config import ConfigError
    from flywheel.store import ArtifactError

    try:
        return _dispatch(args)
    except (ConfigError, ArtifactError, SchemaError, ValueError, FileNotFoundError) as err:
        msg = str(err).splitlines()[0] if str(err) else type(err).__name__
        print(f"flywheel: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("flywheel: interrupted; rerun to resume (finished shards are kept)", file=sys.stderr)
        return 130


def _dispatch(args: argparse.Namespace) -> int:
    if args.command in ("run", "stage"):
        from flywheel.config import load_config

        # A bad config is a one-line error here; inside the flow Prefect would first log a
        # traceback (and start its server) before the error reached us.
        cfg = load_config(_config_path(args.config), args.overrides)
        if args.command == "stage":
            from flows.flywheel import check_plan

            check_plan(cfg, args.name, args.round)
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
        store = _store(args.config)
        if args.action == "ls":
            for ref in store.list(round=args.round, stage=args.stage):
                print(
                    f"round {ref.round}  {ref.stage:<9} {ref.kind:<12} {ref.id:<28} rows={ref.manifest.get('rows')}  {ref.manifest.get('created')}"
                )
            return 0
        if args.action == "show":
            ref = store.get(args.id)
            print(json.dumps(ref.manifest, indent=2, default=str))
            if args.rows:
                print(store.read(ref).slice(0, args.rows).to_pandas().to_string())
            return 0
        _print_lineage(store.lineage(args.id))
        return 0
    if args.command == "report":
        from flywheel.report import collect, format_table

        rows = collect(_store(args.config))
        print(json.dumps(rows, indent=2) if args.json else format_table(rows))
        return 0
    if args.command == "config":
        from flywheel.config import dump_config, field_help, load_config

        if args.fields:
            for key, text in field_help():
                print(f"{key:<40} {text}")
        else:
            print(dump_config(load_config(_config_path(args.config), args.overrides)), end="")
        return 0
    if args.command == "serve":
        from flywheel.serve import serve

        return serve(host=args.host, port=args.port, pool=args.pool)
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
