"""The artifact store: versioned Parquet folders with a manifest and lineage.

Layout: ``<root>/<run>/round-<r>/<stage>/<artifact-id>/`` holding Parquet shards (or a Hugging
Face checkpoint folder) and ``manifest.json``. The id is ``<stage>-<hash>`` where the hash covers
(stage, the stage's resolved config, the input artifact ids, the schema version): running a
stage whose id exists is a cache hit. ``force=True`` writes a new version ``<stage>-<hash>.<n>``;
later runs pick the newest version, so what follows reruns too.

Writes are atomic. Everything goes to a sibling ``.tmp-<id>`` folder; each shard is written to a
``.part`` file and renamed, so a finished shard is complete or absent; the manifest is written
last and the folder renamed into place. A reader only sees folders with a manifest. After a
crash the next run reopens the same ``.tmp-<id>`` folder and keeps its finished shards.

What a commit takes from the ``.tmp-<id>`` folder: only shards that prove they belong there.
Each shard's Parquet footer names the artifact id and the shard index it was written for; a
shard counts as finished (``has_shard``, ``finished_shards``) and is committed only when its
footer reads, names this id and its own index, and its schema matches the contract. Anything
else there (``.part`` files, a shard of another artifact or index, an unreadable shard, one from
before footers were stamped) is not finished, so the stage writes it again, and is deleted at
commit. As for a cache hit, the id is the identity of the content: a finished shard of the same
id from a crashed run is kept even if the code changed since (use ``force`` after a change that
alters results without changing the config).

A folder that holds no manifest (an interrupted commit on an object store, a deleted manifest)
is no artifact: readers skip it, ``scan`` reports it, and the next commit of that id replaces
it. A corrupted manifest is an error for every reader; ``writer(..., force=True)`` replaces
the artifact in place.

How long a stage took is in its manifest: ``started`` (when its writer was opened, UTC),
``seconds`` (from then to the commit, in the process that committed it) and ``resumed`` (true when
the ``.tmp-<id>`` folder held shard files or a saved train state from an earlier, interrupted run
when that process opened it: the earlier run's time is then not counted).

The root is a local path or any fsspec URL (``s3://``, ``gs://``, ``memory://``).

    store = Store("work/store", run="default")
    w = store.writer("trajectories", stage="explore", round=1, config=..., inputs=[ckpt.id])
    if w.cached:
        return w.ref
    for i, rows in enumerate(shards):
        if not w.has_shard(i):
            w.write_shard(i, rows)
    return w.commit(summary={"success_rate": 0.4})
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cache
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq

from data_contracts import CONTRACTS, Contract, SchemaError, table_from_rows, validate_table

MANIFEST = "manifest.json"
# Run names, stage names and artifact ids are single folder names: no '/', no glob characters.
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_SHARD = re.compile(r"part-(\d{5})\.parquet")
# A training stage keeps its resumable train state here, inside its writer's local_dir
# (flywheel/training/loop.py); DeepSpeed names the saved step in its file "latest" ("step500").
TRAIN_STATE_DIR = "_train_state"
# Footer keys that tie a shard to the artifact and index it was written for.
_ARTIFACT_KEY, _SHARD_KEY = b"flywheel.artifact", b"flywheel.shard"


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete or corrupted; the message is one line."""


@dataclass(frozen=True)
class ArtifactRef:
    id: str
    kind: str
    stage: str
    round: int
    path: str  # folder URL or local path
    manifest: dict[str, Any] = field(compare=False, repr=False)

    @property
    def summary(self) -> dict[str, Any]:
        return self.manifest.get("summary", {})

    @property
    def inputs(self) -> list[str]:
        return self.manifest.get("inputs", [])


@dataclass(frozen=True)
class Unfinished:
    """A write not yet committed: a ``.tmp-<id>`` folder that a running stage is filling, or
    that an interrupted one left (rerunning the stage with the same config resumes it)."""

    id: str
    stage: str
    round: int
    path: str
    shards: int  # shard files written (checked against their footers only when resumed)
    train_step: int | None  # the step of the saved train state a training stage resumes from
    modified: datetime | None  # the newest write in the folder, where the filesystem says


def _mtime(info: dict[str, Any]) -> datetime | None:
    """When a file was last written, from an fsspec ``info`` entry: local files give ``mtime``
    (seconds), object stores ``LastModified`` or ``updated`` (a datetime or an ISO string), the
    memory filesystem ``created`` (a shard file is written once)."""
    value = next(
        (info[k] for k in ("mtime", "LastModified", "updated", "created") if k in info), None
    )
    if isinstance(value, int | float):
        return datetime.fromtimestamp(value, UTC)
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=UTC)
    return None


def config_hash(stage: str, config: Any, inputs: list[str], schema_version: int) -> str:
    payload = json.dumps(
        {"stage": stage, "config": config, "inputs": list(inputs), "schema": schema_version},
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:12]


@cache
def code_version() -> str:
    from flywheel import __version__

    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return f"{__version__}+{sha}" if sha else __version__


# The CPU features that decide which matmul kernels torch and oneDNN run (and so how they round).
KERNEL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
# Environment variables that choose the CPU kernels torch runs, read when torch loads:
# ATen's vector kernels (``ATEN_CPU_CAPABILITY=avx2``) and MKL's (``MKL_CBWR``, the matrix
# products). Pinned to AVX2, an AVX-512 machine runs the kernels an AVX2 one does
# (benchmarks/kernels.py shows what each setting changes).
KERNEL_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


@cache
def _cpu() -> tuple[str, tuple[str, ...]]:
    """The CPU's model name and which of ``KERNEL_FLAGS`` it has (Linux; elsewhere the
    platform's processor string and no flags)."""
    name, flags = "", set[str]()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and not name:
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), tuple(
        f for f in KERNEL_FLAGS if f in flags
    )


def host_info() -> dict[str, Any]:
    """The machine that wrote an artifact, for its manifest: the CPU and its kernel features
    (``KERNEL_FLAGS``); where the process has loaded torch, also its version, the kernels it
    picked for that CPU (``AVX512``, ``AVX2``, ...), its thread count and the GPU in use.

    The artifact id hashes none of it, though the same config trains to different weights
    where torch runs other kernels (float32 on CPU too: the vector width changes the order of a
    sum; docs/results.md, "One config, two machines"): this is how a reader tells such artifacts
    apart. ``kernel_env`` holds the ``KERNEL_ENV`` variables that are set. torch is not imported
    for it, so data-only stages stay light."""
    name, flags = _cpu()
    host: dict[str, Any] = {"cpu": name, "cpu_flags": list(flags), "cores": os.cpu_count()}
    pinned = {k: os.environ[k] for k in KERNEL_ENV if os.environ.get(k)}
    if pinned:
        host["kernel_env"] = pinned
    torch = sys.modules.get("torch")
    if torch is not None:
        host["torch"] = str(torch.__version__)
        host["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
        host["threads"] = torch.get_num_threads()
        if torch.cuda.is_initialized():
            host["gpu"] = torch.cuda.get_device_name()
    return host


def host_label(host: dict[str, Any]) -> str:
    """One line for a manifest's ``host``: the CPU, its torch kernels and threads, the GPU."""
    parts = [str(host.get("cpu", "?"))]
    if host.get("cpu_flags"):
        parts.append(" ".join(host["cpu_flags"]))
    if "cpu_capability" in host:
        parts.append(f"{host['cpu_capability']}, {host.get('threads', '?')} threads")
    if host.get("kernel_env"):
        parts.append(" ".join(f"{k}={v}" for k, v in sorted(host["kernel_env"].items())))
    if "gpu" in host:
        parts.append(str(host["gpu"]))
    return ", ".join(parts)


def read_parquet(fh: Any, columns: list[str] | None = None) -> pa.Table:
    """A Parquet file (an open binary file) as a table, read from a copy in Arrow's own memory.

    Handed a Python object (the file, or bytes), pyarrow keeps a reference to it in the reader,
    and the reader can be freed on one of pyarrow's pool threads after ``read_table`` returned.
    Freeing it takes the GIL, and at interpreter exit that makes the thread exit inside C++:
    the process aborted after its work was done (``terminate called without an active
    exception``, exit 134; apache/arrow issues 34314 and 50482). Measured with pyarrow 25.0.1
    on the 2-core box under load: ``flywheel compare`` aborted in 10 to 12 of 60 runs reading
    the shards straight from the fsspec handle, with or without ``use_threads``. Copied into an
    Arrow buffer, nothing of Python's is left to free: 0 of 120 runs aborted."""
    sink = pa.BufferOutputStream()
    sink.write(fh.read())
    return pq.read_table(pa.BufferReader(sink.getvalue()), columns=columns)


def check_plain(what: str, name: str) -> str:
    """``name`` if it is one plain folder name, else a one-line ArtifactError."""
    if not _PLAIN.fullmatch(name) or ".." in name:
        raise ArtifactError(
            f"{what + ' ' if what else ''}{name!r} is not a plain name (letters, digits, '_', '-', '.'; "
            "no '/', '..' or glob characters)"
        )
    return name


class Store:
    def __init__(self, root: str, run: str = "default"):
        check_plain("run name", run)
        self.root_url = root
        self.run = run
        self.fs, base = fsspec.core.url_to_fs(root)
        self.base = base.rstrip("/") + "/" + run
        self.local = _is_local(self.fs)
        self.committed: set[str] = set()  # ids written by this process (the rest were cache hits)

    # -- paths ---------------------------------------------------------------------------------
    def _stage_dir(self, round: int, stage: str) -> str:
        return f"{self.base}/round-{round}/{stage}"

    def _url(self, path: str) -> str:
        return path if self.local else self.fs.unstrip_protocol(path)

    # -- writing -------------------------------------------------------------------------------
    def writer(
        self,
        kind: str,
        *,
        stage: str,
        round: int,
        config: Any,
        inputs: list[str],
        force: bool = False,
    ) -> ArtifactWriter:
        contract = _contract(kind)
        check_plain("stage", stage)
        digest = config_hash(stage, config, inputs, contract.version)
        base_id = f"{stage}-{digest}"
        newest = self._newest(round, stage, base_id)
        if newest is None:
            return ArtifactWriter(self, contract, stage, round, base_id, config, inputs)
        try:
            latest = self._load(newest)
        except ArtifactError as err:
            if not force:
                raise ArtifactError(f"{err} (force a new version to replace it)") from None
            # Unreadable, so nothing can depend on it: the new version takes its place.
            art_id = newest.rsplit("/", 1)[-1]
            return ArtifactWriter(self, contract, stage, round, art_id, config, inputs)
        if not force:
            return ArtifactWriter(
                self, contract, stage, round, latest.id, config, inputs, cached=latest
            )
        art_id = f"{base_id}.{_version(newest.rsplit('/', 1)[-1]) + 1}"
        return ArtifactWriter(self, contract, stage, round, art_id, config, inputs)

    # -- reading -------------------------------------------------------------------------------
    def _newest(self, round: int, stage: str, base_id: str) -> str | None:
        """The folder of the newest version of ``base_id`` that holds a manifest (by folder
        name, so that a corrupted manifest does not hide which version it is)."""
        stage_dir = self._stage_dir(round, stage)
        best: tuple[int, str] | None = None
        for path in self.fs.glob(f"{stage_dir}/{base_id}*/{MANIFEST}"):
            folder = path.rsplit("/", 1)[0]
            name = folder.rsplit("/", 1)[-1]
            if name != base_id and not (
                name.startswith(base_id + ".") and name[len(base_id) + 1 :].isdigit()
            ):
                continue
            if best is None or _version(name) > best[0]:
                best = (_version(name), folder)
        return None if best is None else best[1]

    def _load(self, folder: str) -> ArtifactRef:
        path = f"{folder}/{MANIFEST}"
        try:
            with self.fs.open(path, "r") as fh:
                manifest = json.load(fh)
            return ArtifactRef(
                id=manifest["id"],
                kind=manifest["kind"],
                stage=manifest["stage"],
                round=int(manifest["round"]),
                path=self._url(folder),
                manifest=manifest,
            )
        except FileNotFoundError:
            raise ArtifactError(f"artifact folder {self._url(folder)} has no manifest") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ArtifactError(f"corrupted manifest {self._url(path)}: {err}") from None

    def _pattern(self, round: int | None, stage: str | None) -> str:
        if round is not None and round < 0:
            raise ArtifactError(f"round must be >= 0, got {round}")
        r = "*" if round is None else str(round)
        s = "*" if stage is None else check_plain("stage", stage)
        return f"{self.base}/round-{r}/{s}"

    def list(self, round: int | None = None, stage: str | None = None) -> list[ArtifactRef]:
        """Every artifact (oldest first); a corrupted manifest is an error, a folder without
        one is skipped (``scan`` reports both)."""
        pattern = self._pattern(round, stage)
        refs = [self._load(p.rsplit("/", 1)[0]) for p in self.fs.glob(f"{pattern}/*/{MANIFEST}")]
        return sorted(refs, key=lambda ref: (ref.round, ref.manifest.get("created", ""), ref.id))

    def scan(
        self, round: int | None = None, stage: str | None = None
    ) -> tuple[builtins.list[ArtifactRef], builtins.list[str]]:
        """Every artifact that reads, and a one-line problem for every artifact folder that
        does not (no manifest, or a corrupted one). Unfinished writes (``.tmp-*``) are not
        artifacts yet and are left out."""
        refs, problems = [], []
        for folder in sorted(self.fs.glob(f"{self._pattern(round, stage)}/*")):
            if folder.rsplit("/", 1)[-1].startswith(".") or not self.fs.isdir(folder):
                continue
            if not self.fs.exists(f"{folder}/{MANIFEST}"):
                problems.append(
                    f"incomplete artifact {self._url(folder)}: no {MANIFEST} "
                    "(an interrupted commit; rerunning its stage replaces it)"
                )
                continue
            try:
                refs.append(self._load(folder))
            except ArtifactError as err:
                problems.append(str(err))
        refs.sort(key=lambda ref: (ref.round, ref.manifest.get("created", ""), ref.id))
        return refs, problems

    def unfinished(
        self, round: int | None = None, stage: str | None = None
    ) -> builtins.list[Unfinished]:
        """The writes in progress or interrupted (``.tmp-<id>`` folders), oldest round first:
        what ``artifacts ls`` shows of a run that is still going, or was stopped."""
        found = []
        for folder in sorted(self.fs.glob(f"{self._pattern(round, stage)}/.tmp-*")):
            if not self.fs.isdir(folder):
                continue
            *_, round_dir, stage_name, name = folder.rsplit("/", 3)
            try:
                shards, step, entries = self._held(folder)
                entries.append(self.fs.info(folder))  # an empty folder: when it was made
            except FileNotFoundError:
                continue  # committed (renamed into place) while this looked: not unfinished
            times = [t for t in map(_mtime, entries) if t is not None]
            found.append(
                Unfinished(
                    id=name.removeprefix(".tmp-"),
                    stage=stage_name,
                    round=int(round_dir.removeprefix("round-")),
                    path=self._url(folder),
                    shards=shards,
                    train_step=step,
                    modified=max(times) if times else None,
                )
            )
        return sorted(found, key=lambda u: (u.round, u.stage, u.id))

    def _held(self, folder: str) -> tuple[int, int | None, builtins.list[dict[str, Any]]]:
        """What a ``.tmp-<id>`` folder holds that a rerun of its stage takes over: the shard
        files, the step of a saved train state (None without one), and the fsspec entries read."""
        entries = self.fs.ls(folder, detail=True)
        shards = sum(1 for e in entries if _SHARD.fullmatch(e["name"].rsplit("/", 1)[-1]))
        latest = f"{folder}/{TRAIN_STATE_DIR}/latest"
        if not self.fs.exists(latest):
            return shards, None, entries
        tag = self.fs.cat_file(latest).decode().strip()
        step = int(tag[4:]) if tag.startswith("step") and tag[4:].isdigit() else None
        return shards, step, [*entries, self.fs.info(latest)]

    def get(self, artifact_id: str) -> ArtifactRef:
        """Find an artifact by id anywhere in this run."""
        check_plain("artifact id", artifact_id)
        stage = artifact_id.split("-", 1)[0]
        hits = self.fs.glob(f"{self.base}/round-*/{stage}/{artifact_id}/{MANIFEST}")
        if not hits:
            folders = self.fs.glob(f"{self.base}/round-*/{stage}/{artifact_id}")
            if folders:
                raise ArtifactError(
                    f"artifact {artifact_id} is incomplete: {self._url(folders[0])} has no {MANIFEST}"
                )
            raise ArtifactError(f"no artifact {artifact_id} in {self.root_url}/{self.run}")
        return self._load(hits[0].rsplit("/", 1)[0])

    def latest(self, stage: str, round: int | None = None) -> ArtifactRef | None:
        """Newest artifact a stage wrote (in one round, or in any)."""
        refs = self.list(round=round, stage=stage)
        return refs[-1] if refs else None

    # ``builtins.list``: in the class body ``list`` names the method above.
    def read(self, ref: ArtifactRef | str, columns: builtins.list[str] | None = None) -> pa.Table:
        """All rows of a table artifact, validated against its contract."""
        ref = self.get(ref) if isinstance(ref, str) else ref
        contract = _contract(ref.kind)
        if ref.manifest.get("schema_version") != contract.version:
            raise SchemaError(
                f"schema mismatch in {ref.path}: written with {ref.kind} "
                f"v{ref.manifest.get('schema_version')}, this code reads v{contract.version}"
            )
        folder = ref.path if self.local else self.fs._strip_protocol(ref.path)
        tables = []
        for name in ref.manifest.get("shards", []):
            path = f"{folder}/{name}"
            try:
                with self.fs.open(path, "rb") as fh:
                    table = read_parquet(fh)
            except FileNotFoundError:
                raise ArtifactError(
                    f"artifact {ref.id} is missing shard {self._url(path)}"
                ) from None
            except (pa.ArrowInvalid, OSError) as err:
                raise ArtifactError(
                    f"corrupted shard {self._url(path)}: {str(err).splitlines()[0]}"
                ) from None
            table = table.replace_schema_metadata(contract.schema.metadata)  # drop the stamp
            tables.append(validate_table(contract, table, self._url(path)))
        if not tables:
            return contract.schema.empty_table()
        table = pa.concat_tables(tables)
        if table.num_rows != ref.manifest.get("rows"):
            raise ArtifactError(
                f"artifact {ref.id} has {table.num_rows} rows, manifest says {ref.manifest.get('rows')}"
            )
        return table.select(columns) if columns else table

    def local_path(self, ref: ArtifactRef) -> Path:
        """A local folder holding the artifact's files (downloaded once for remote stores)."""
        if self.local:
            return Path(ref.path)
        cache_dir = Path(tempfile.gettempdir()) / "flywheel-cache" / ref.id
        if not (cache_dir / MANIFEST).exists():
            tmp = cache_dir.with_name(cache_dir.name + ".partial")
            shutil.rmtree(tmp, ignore_errors=True)
            self.fs.get(self.fs._strip_protocol(ref.path) + "/", str(tmp) + "/", recursive=True)
            tmp.rename(cache_dir)
        return cache_dir

    def ancestors(
        self, ids: Iterable[str], skip_missing: bool = False
    ) -> builtins.list[ArtifactRef]:
        """The given artifacts and everything they were made from, each once, as a flat list
        (``lineage`` is the nested tree ``flywheel artifacts lineage`` prints). A missing input
        raises ``ArtifactError``, or is left out with ``skip_missing``."""
        found: dict[str, ArtifactRef] = {}
        todo = builtins.list(ids)
        while todo:
            art_id = todo.pop()
            if art_id in found:
                continue
            try:
                found[art_id] = self.get(art_id)
            except ArtifactError:
                if not skip_missing:
                    raise
                continue
            todo.extend(i for i in found[art_id].inputs if isinstance(i, str))
        return builtins.list(found.values())

    def lineage(self, artifact_id: str, _path: tuple[str, ...] = ()) -> dict[str, Any]:
        """The artifact and, recursively, everything it was made from."""
        if artifact_id in _path:
            cycle = " -> ".join((*_path[_path.index(artifact_id) :], artifact_id))
            raise ArtifactError(f"lineage cycle: {cycle} (a manifest's inputs were edited)")
        ref = self.get(artifact_id)
        inputs = ref.inputs
        if not isinstance(inputs, builtins.list) or not all(isinstance(i, str) for i in inputs):
            raise ArtifactError(f"corrupted manifest of {ref.id}: inputs is not a list of ids")
        return {
            "id": ref.id,
            "kind": ref.kind,
            "stage": ref.stage,
            "round": ref.round,
            "summary": ref.summary,
            "inputs": [self.lineage(i, (*_path, artifact_id)) for i in inputs],
        }


class ArtifactWriter:
    """Writes one artifact version; see the module docstring for the protocol."""

    def __init__(
        self,
        store: Store,
        contract: Contract,
        stage: str,
        round: int,
        art_id: str,
        config: Any,
        inputs: list[str],
        cached: ArtifactRef | None = None,
    ):
        self.store = store
        self.contract = contract
        self.stage = stage
        self.round = round
        self.id = art_id
        self.config = config
        self.inputs = list(inputs)
        self.cached = cached
        stage_dir = store._stage_dir(round, stage)
        self.final_dir = f"{stage_dir}/{art_id}"
        self.tmp_dir = f"{stage_dir}/.tmp-{art_id}"
        self._local_tmp: Path | None = None
        self._rows: dict[int, int] = {}  # finished shards known to belong here -> rows
        # The stage's clock (module docstring): it starts when the stage opens its writer.
        self._started = datetime.now(UTC)
        self._t0 = time.monotonic()
        self._resumed = False
        if cached is None:
            fs = store.fs
            if fs.isdir(self.tmp_dir):  # what an interrupted run left, that this one takes over
                shards, step, _ = store._held(self.tmp_dir)
                self._resumed = bool(shards) or step is not None
            fs.makedirs(self.tmp_dir, exist_ok=True)

    @property
    def ref(self) -> ArtifactRef:
        if self.cached is None:
            raise ArtifactError(f"artifact {self.id} is not written yet")
        return self.cached

    @staticmethod
    def shard_name(index: int) -> str:
        return f"part-{index:05d}.parquet"

    def has_shard(self, index: int) -> bool:
        """Whether shard ``index`` is finished: written by this writer, or left by a crashed
        run of this artifact and verified (module docstring)."""
        return index in self._rows or self._verify(index)

    def finished_shards(self) -> list[int]:
        return sorted(i for i in self._shards_on_disk() if self.has_shard(i))

    def _shards_on_disk(self) -> list[int]:
        names = (n.rsplit("/", 1)[-1] for n in self.store.fs.ls(self.tmp_dir, detail=False))
        return sorted(int(m[1]) for m in map(_SHARD.fullmatch, names) if m)

    def _verify(self, index: int) -> bool:
        """Read shard ``index``'s footer: it must name this artifact and this index, and its
        schema must match the contract."""
        path = f"{self.tmp_dir}/{self.shard_name(index)}"
        try:
            with self.store.fs.open(path, "rb") as fh:
                footer = pq.ParquetFile(fh)
                meta = footer.schema_arrow.metadata or {}
                rows = footer.metadata.num_rows
                validate_table(self.contract, footer.schema_arrow.empty_table(), path)
        except (OSError, pa.ArrowException, SchemaError):
            return False  # absent, unreadable or of another shape: written again
        if (
            meta.get(_ARTIFACT_KEY) != self.id.encode()
            or meta.get(_SHARD_KEY) != str(index).encode()
        ):
            return False
        self._rows[index] = rows
        return True

    def write_shard(self, index: int, rows: list[dict[str, Any]] | pa.Table) -> int:
        """Validate and write one shard atomically; returns its row count."""
        name = self.shard_name(index)
        where = self.store._url(f"{self.final_dir}/{name}")
        if isinstance(rows, pa.Table):
            table = validate_table(self.contract, rows, where)
        else:
            table = table_from_rows(self.contract, rows, where)
        stamp = {_ARTIFACT_KEY: self.id.encode(), _SHARD_KEY: str(index).encode()}
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), **stamp})
        buf = io.BytesIO()
        pq.write_table(table, buf, compression="zstd")
        fs = self.store.fs
        part = f"{self.tmp_dir}/{name}.part"
        with fs.open(part, "wb") as fh:
            fh.write(buf.getvalue())
        fs.mv(part, f"{self.tmp_dir}/{name}")
        self._rows[index] = table.num_rows
        return table.num_rows

    def read_shard(self, index: int, columns: list[str] | None = None) -> pa.Table:
        """One finished shard (``columns`` of it), as written."""
        with self.store.fs.open(f"{self.tmp_dir}/{self.shard_name(index)}", "rb") as fh:
            return read_parquet(fh, columns=columns)

    def read_shards(self) -> pa.Table:
        """The finished shards written so far (this run's and a crashed run's), validated."""
        tables = []
        for i in self.finished_shards():
            with self.store.fs.open(f"{self.tmp_dir}/{self.shard_name(i)}", "rb") as fh:
                table = read_parquet(fh).replace_schema_metadata(self.contract.schema.metadata)
                tables.append(validate_table(self.contract, table, self.shard_name(i)))
        return pa.concat_tables(tables) if tables else self.contract.schema.empty_table()

    def local_dir(self) -> Path:
        """A local folder for file artifacts (checkpoints); committed with the manifest."""
        if self.store.local:
            return Path(self.tmp_dir)
        if self._local_tmp is None:
            self._local_tmp = Path(tempfile.mkdtemp(prefix=f"flywheel-{self.id}-"))
        return self._local_tmp

    def commit(
        self, summary: dict[str, Any] | None = None, extra: dict[str, Any] | None = None
    ) -> ArtifactRef:
        fs = self.store.fs
        if self._local_tmp is not None:
            fs.put(str(self._local_tmp) + "/", self.tmp_dir + "/", recursive=True)
            shutil.rmtree(self._local_tmp, ignore_errors=True)
        finished = self.finished_shards()
        # Only verified shards are committed: the rest (.part files, shards of another
        # artifact or index, unreadable ones) must not reach the artifact's folder.
        for name in fs.ls(self.tmp_dir, detail=False):
            base = name.rsplit("/", 1)[-1]
            shard = _SHARD.fullmatch(base)
            if base.endswith(".parquet.part") or (shard and int(shard[1]) not in finished):
                fs.rm(name)
        shards = [self.shard_name(i) for i in finished]
        rows = sum(self._rows[i] for i in finished)
        manifest = {
            "id": self.id,
            "kind": self.contract.kind,
            "stage": self.stage,
            "round": self.round,
            "run": self.store.run,
            "schema_version": self.contract.version,
            "rows": rows,
            "shards": shards,
            "inputs": self.inputs,
            "config_hash": self.id.split("-", 1)[1].split(".")[0],
            "config": self.config,
            "code_version": code_version(),
            "host": host_info(),
            "created": datetime.now(UTC).isoformat(timespec="microseconds"),
            "started": self._started.isoformat(timespec="microseconds"),
            "seconds": round(time.monotonic() - self._t0, 1),
            "resumed": self._resumed,
            "summary": summary or {},
            **(extra or {}),
        }
        text = json.dumps(manifest, indent=2, sort_keys=False, default=str)
        if self.store.local:
            # The folder rename is the commit point: the manifest is inside before it happens.
            with open(f"{self.tmp_dir}/{MANIFEST}", "w") as fh:
                fh.write(text)
                fh.flush()
                os.fsync(fh.fileno())
            if os.path.exists(self.final_dir):
                shutil.rmtree(self.final_dir)  # a manifest-less leftover of an earlier crash
            os.rename(self.tmp_dir, self.final_dir)
        else:
            # No atomic folder rename on object stores: copy, then write the manifest last.
            fs.mv(self.tmp_dir, self.final_dir, recursive=True)
            with fs.open(f"{self.final_dir}/{MANIFEST}", "w") as fh:
                fh.write(text)
        self.cached = self.store._load(self.final_dir)
        self.store.committed.add(self.id)
        return self.cached


def flatten_config(data: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config as ``{"a.b": value}``; a list of sections is keyed by each one's
    ``name`` (``envs.arith.n_test``), other lists and scalars are leaves. MLflow's params and
    ``rerun_reason`` both read configs this way."""
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(flatten_config(v, f"{prefix}{k}."))
        return out
    if isinstance(data, list) and data and all(isinstance(x, dict) for x in data):
        out = {}
        for i, v in enumerate(data):
            out.update(flatten_config(v, f"{prefix}{v.get('name', str(i))}."))
        return out
    return {prefix.rstrip("."): data}


def rerun_reason(store: Store, ref: ArtifactRef, shown: int = 5) -> str | None:
    """Why a stage computed ``ref`` rather than finding it: the nearest earlier artifact of the
    same stage and round made from the same inputs (fewest differing config keys; the newest of
    those), and the keys the two differ in (``"same inputs as init-043fe5ad2313; config
    differs in revision_noops"``). None when there is none: a first run, or new inputs, which
    say why by themselves. Artifacts this process wrote (a stage's other outputs, such as the
    tasks stage's splits) are not earlier runs and are left out."""
    mine = flatten_config(ref.manifest.get("config", {}))
    best: tuple[int, ArtifactRef, list[str]] | None = None
    earlier, _ = store.scan(round=ref.round, stage=ref.stage)  # a corrupted one: not a reason
    for other in reversed(earlier):
        if other.id in store.committed or other.inputs != ref.inputs:
            continue
        if other.id.split(".")[0] == ref.id.split(".")[0]:
            continue  # an earlier version of the same config (``force``)
        theirs = flatten_config(other.manifest.get("config", {}))
        keys = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        if keys and (best is None or len(keys) < best[0]):
            best = (len(keys), other, keys)
    if best is None:
        return None
    _, other, keys = best
    more = f" and {len(keys) - shown} more" if len(keys) > shown else ""
    return f"same inputs as {other.id}; config differs in {', '.join(keys[:shown])}{more}"


def _contract(kind: str) -> Contract:
    try:
        return CONTRACTS[kind]
    except KeyError:
        raise ArtifactError(
            f"unknown artifact kind {kind!r}; known: {', '.join(sorted(CONTRACTS))}"
        ) from None


def _version(art_id: str) -> int:
    tail = art_id.rsplit(".", 1)
    return int(tail[1]) if len(tail) == 2 and tail[1].isdigit() else 1


def _is_local(fs: fsspec.AbstractFileSystem) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")
