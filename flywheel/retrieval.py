"""Dense retrieval for retrieval envs (``wiki``): embedders, FAISS indexes, and the HTTP server.

An embedder turns texts into L2-normalised float32 vectors, so inner product is cosine:

- ``hashing`` (default): word and character n-gram features hashed into ``dim`` signed buckets.
  Deterministic, no download, no training; good enough for entity-name queries.
- ``sentence_transformers``: a model loaded from a LOCAL folder (``path``); the package is
  imported only then, and is not a dependency of the project.

An index is ``flat`` (``IndexFlatIP``, exact) or ``hnsw`` (``IndexHNSWFlat`` with inner product).
The ``index`` stage writes an index artifact (``data_contracts/index.py``): the passages as
Parquet (row i is vector i), ``index.faiss`` (``faiss.write_index``), and the embedder and index
settings in the manifest's config. Episodes search it in-process, or through a server::

    retriever = LocalRetriever.build(passages, EmbedderSettings(), IndexSettings(kind="hnsw"))
    retriever = load_retriever(ref.path)        # an index artifact folder (path or fsspec URL)
    hits = retriever.search("Aldric Venn", k=3)  # [Hit(id, text, score), ...]

    flywheel retriever serve INDEX_ARTIFACT_ID --port 8100   # POST /search, GET /health
    RemoteRetriever("http://127.0.0.1:8100").search("Aldric Venn", k=3)
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

INDEX_FILE = "index.faiss"
GRACEFUL_SHUTDOWN_S = 5
# Function words carry no entity: dropping them keeps "Where was X born?" close to "X".
STOPWORDS = frozenset(
    ("a", "an", "the", "is", "was", "are", "were", "be", "been", "of", "in", "on", "at", "to",
     "by", "for", "and", "or", "who", "whom", "what", "where", "which", "when", "how", "did",
     "does", "do", "its", "it", "this", "that", "with", "from", "as")
)  # fmt: skip
CHAR_WEIGHT = 0.5  # the char n-grams of a word weigh this much together; the word itself 1.0
_WORD = re.compile(r"[a-z0-9]+")


class RetrieverError(RuntimeError):
    """The retriever cannot answer (server down, bad artifact, missing model); one line."""


# -- settings ---------------------------------------------------------------------------------


class EmbedderSettings(BaseModel):
    """Which embedder turns passages and queries into vectors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: Literal["hashing", "sentence_transformers"] = Field(
        default="hashing",
        description="hashing: built-in feature hashing; sentence_transformers: a local model.",
    )
    dim: int = Field(default=1024, ge=16, le=1 << 16, description="Vector size (hashing only).")
    char_ngrams: tuple[int, ...] = Field(
        default=(3,), description="Character n-gram sizes hashed with each word (hashing only)."
    )
    path: str | None = Field(
        default=None, description="Local sentence-transformers model folder (no download)."
    )
    batch_size: int = Field(default=64, ge=1, description="Texts per encode call.")

    @model_validator(mode="after")
    def _needs_path(self) -> EmbedderSettings:
        if self.kind == "sentence_transformers" and not self.path:
            raise ValueError("embedder.kind sentence_transformers needs embedder.path")
        if any(n < 1 or n > 8 for n in self.char_ngrams):
            raise ValueError(f"char_ngrams must be sizes in 1..8, got {list(self.char_ngrams)}")
        return self


class IndexSettings(BaseModel):
    """Which FAISS index holds the vectors."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    kind: Literal["flat", "hnsw"] = Field(
        default="flat", description="flat: exact IndexFlatIP; hnsw: IndexHNSWFlat (inner product)."
    )
    hnsw_m: int = Field(default=32, ge=4, le=256, description="HNSW links per node.")
    ef_construction: int = Field(default=200, ge=8, description="HNSW build-time beam width.")
    ef_search: int = Field(default=128, ge=1, description="HNSW search-time beam width.")
    gpu: bool = Field(
        default=False,
        description="Search a flat index on the GPU (needs faiss-gpu: the `gpu` extra).",
    )


# -- embedders --------------------------------------------------------------------------------


class Embedder(Protocol):
    dim: int

    def encode(self, texts: list[str]) -> np.ndarray:
        """float32 array (len(texts), dim), each row L2-normalised (or zero)."""
        ...


@lru_cache(maxsize=1 << 18)
def _bucket(feature: str, dim: int) -> tuple[int, float]:
    # A keyed hash, not Python's hash(): the same text must give the same vector in every process.
    value = int.from_bytes(hashlib.blake2b(feature.encode(), digest_size=8).digest(), "big")
    return value % dim, 1.0 if value >> 63 else -1.0


def _features(text: str, ngrams: tuple[int, ...]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for word in _WORD.findall(text.lower()):
        if word in STOPWORDS:
            continue
        out.append(("w:" + word, 1.0))
        padded = f"#{word}#"
        grams = [f"c{n}:{padded[i : i + n]}" for n in ngrams for i in range(len(padded) - n + 1)]
        out.extend((g, CHAR_WEIGHT / len(grams)) for g in grams)
    return out


class HashingEmbedder:
    """Signed feature hashing of words (weight 1) and their char n-grams (weight 0.5 in all)."""

    def __init__(self, dim: int = 1024, char_ngrams: tuple[int, ...] = (3,)) -> None:
        self.dim, self.char_ngrams = dim, tuple(char_ngrams)

    def encode(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            for feature, weight in _features(text, self.char_ngrams):
                col, sign = _bucket(feature, self.dim)
                out[row, col] += sign * weight
        norms = np.linalg.norm(out, axis=1, keepdims=True)
        return out / np.maximum(norms, 1e-12)


def check_embedder(settings: EmbedderSettings) -> None:
    """A one-line ValueError when the embedder cannot load here: a sentence-transformers folder
    that does not exist, or the package missing (checked without importing it)."""
    if settings.kind != "sentence_transformers":
        return
    if not Path(str(settings.path)).expanduser().is_dir():
        raise ValueError(
            f"embedder.path {settings.path!r} is not a folder (a local sentence-transformers "
            "model; nothing is downloaded)"
        )
    if importlib.util.find_spec("sentence_transformers") is None:
        raise ValueError(
            "embedder.kind sentence_transformers needs the sentence-transformers package, "
            "which is not installed (pip install sentence-transformers)"
        )


class SentenceTransformerEmbedder:
    """A sentence-transformers model from a local folder; encodes under a lock (one model)."""

    def __init__(self, path: str, batch_size: int = 64) -> None:
        try:
            check_embedder(EmbedderSettings(kind="sentence_transformers", path=path))
        except ValueError as err:
            raise RetrieverError(str(err)) from None
        from sentence_transformers import SentenceTransformer

        folder = Path(path).expanduser()
        try:
            self.model = SentenceTransformer(str(folder), local_files_only=True)
        except Exception as err:  # a folder that is no model: one line, whatever the cause
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise RetrieverError(
                f"embedder.path {path!r}: cannot load the model: {first}"
            ) from None
        dim = self.model.get_sentence_embedding_dimension()
        if not dim:
            raise RetrieverError(f"embedder.path {path!r}: the model names no embedding size")
        self.dim, self.batch_size = int(dim), batch_size
        self._lock = threading.Lock()

    def encode(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            vectors = self.model.encode(
                texts, batch_size=self.batch_size, normalize_embeddings=True, convert_to_numpy=True
            )
        return np.asarray(vectors, dtype=np.float32).reshape(len(texts), self.dim)


def make_embedder(settings: EmbedderSettings) -> Embedder:
    if settings.kind == "hashing":
        return HashingEmbedder(settings.dim, settings.char_ngrams)
    assert settings.path is not None  # the settings' validator
    return SentenceTransformerEmbedder(settings.path, settings.batch_size)


# -- indexes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str


@dataclass(frozen=True)
class Hit:
    id: str
    text: str
    score: float


class Retriever(Protocol):
    def search(self, query: str, k: int) -> list[Hit]: ...

    def describe(self) -> dict[str, Any]:
        """What the index was built from (the index artifact's config)."""
        ...


def build_index(vectors: np.ndarray, settings: IndexSettings) -> Any:
    import faiss

    vectors = np.ascontiguousarray(vectors, dtype=np.float32)
    if settings.kind == "flat":
        flat = faiss.IndexFlatIP(vectors.shape[1])
        flat.add(vectors)
        return flat
    index = faiss.IndexHNSWFlat(vectors.shape[1], settings.hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = settings.ef_construction
    index.hnsw.efSearch = settings.ef_search
    # A multi-threaded HNSW build links nodes in whatever order the threads reach them: one
    # thread makes the graph, hence the artifact, the same on every rerun.
    threads = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    try:
        index.add(vectors)
    finally:
        faiss.omp_set_num_threads(threads)
    return index


def _to_gpu(index: Any, settings: IndexSettings) -> Any:
    import faiss

    if not settings.gpu:
        return index
    if settings.kind != "flat":
        raise RetrieverError("index.gpu works with index.kind flat only (faiss has no GPU HNSW)")
    if not hasattr(faiss, "StandardGpuResources") or faiss.get_num_gpus() < 1:
        raise RetrieverError(
            "index.gpu needs faiss-gpu and a CUDA device (pip install '.[gpu]'); this faiss has none"
        )
    return faiss.index_cpu_to_gpu(faiss.StandardGpuResources(), 0, index)


class LocalRetriever:
    """Passages, their FAISS index and the embedder of queries, in this process. Searches may
    run from several threads at once (FAISS CPU searches are thread-safe)."""

    def __init__(
        self, passages: list[Passage], index: Any, embedder: Embedder, config: dict[str, Any]
    ) -> None:
        if index.ntotal != len(passages):
            raise RetrieverError(f"index holds {index.ntotal} vectors for {len(passages)} passages")
        self.passages, self.index, self.embedder, self.config = passages, index, embedder, config

    @classmethod
    def build(
        cls,
        passages: list[Passage],
        embedder: EmbedderSettings,
        index: IndexSettings,
        config: dict[str, Any] | None = None,
    ) -> LocalRetriever:
        model = make_embedder(embedder)
        vectors = model.encode([p.text for p in passages])
        built = build_index(vectors, index)
        config = config or {"embedder": embedder.model_dump(), "index": index.model_dump()}
        return cls(passages, _to_gpu(built, index), model, config)

    def search(self, query: str, k: int) -> list[Hit]:
        k = min(k, len(self.passages))
        if k < 1:
            return []
        scores, ids = self.index.search(self.embedder.encode([query]), k)
        return [
            Hit(self.passages[i].id, self.passages[i].text, float(s))
            for s, i in zip(scores[0], ids[0], strict=True)
            if i >= 0  # HNSW pads with -1 when it finds fewer than k
        ]

    def describe(self) -> dict[str, Any]:
        return {"config": self.config, "passages": len(self.passages)}

    def write_index(self, folder: Path) -> None:
        """``index.faiss`` into ``folder`` (the passages go through the store's writer)."""
        import faiss

        index = self.index
        if hasattr(faiss, "index_gpu_to_cpu") and "Gpu" in type(index).__name__:
            index = faiss.index_gpu_to_cpu(index)
        faiss.write_index(index, str(folder / INDEX_FILE))


def load_retriever(folder: str, *, gpu: bool = False) -> LocalRetriever:
    """The retriever of an index artifact folder (a local path or an fsspec URL); the embedder
    and index settings come from its manifest."""
    import faiss
    import fsspec

    from data_contracts import CONTRACTS, validate_table
    from flywheel.store import read_parquet

    fs, base = fsspec.core.url_to_fs(folder)
    base = base.rstrip("/")
    try:
        with fs.open(f"{base}/manifest.json", "r") as fh:
            manifest = json.load(fh)
        if manifest.get("kind") != "index":
            raise RetrieverError(f"{folder} is a {manifest.get('kind')} artifact, not an index")
        config = manifest["config"]
        tables = []
        for name in manifest["shards"]:
            with fs.open(f"{base}/{name}", "rb") as fh:
                tables.append(validate_table(CONTRACTS["index"], read_parquet(fh), name))
        with fs.open(f"{base}/{INDEX_FILE}", "rb") as fh:
            index = faiss.deserialize_index(np.frombuffer(fh.read(), dtype=np.uint8))
    except FileNotFoundError as err:
        raise RetrieverError(
            f"{folder} is no index artifact: missing {err.filename or err}"
        ) from None
    except (KeyError, TypeError, json.JSONDecodeError) as err:
        raise RetrieverError(f"{folder}: corrupted manifest ({err})") from None
    passages = [Passage(**row) for t in tables for row in t.to_pylist()]
    embedder = EmbedderSettings.model_validate(config["embedder"])
    settings = IndexSettings.model_validate({**config["index"], "gpu": gpu})
    return LocalRetriever(passages, _to_gpu(index, settings), make_embedder(embedder), config)


# -- HTTP: the server and its client ----------------------------------------------------------


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    query: str = Field(min_length=1, max_length=4096)
    k: int = Field(default=3, ge=1, le=100)


class RemoteRetriever:
    """A client of ``flywheel retriever serve``: a timeout per request, retries with backoff on
    connection errors and 5xx, then a one-line RetrieverError."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, retries: int = 2) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.retries = retries
        self._client = httpx.Client(timeout=timeout_s)

    def _request(self, method: str, route: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(min(0.2 * 2 ** (attempt - 1), 2.0))
            try:
                reply = self._client.request(method, f"{self.url}{route}", json=body)
            except httpx.HTTPError as err:
                last = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
                continue
            if reply.status_code >= 500:
                last = f"HTTP {reply.status_code}"
                continue
            try:
                data = reply.json()
            except ValueError:
                raise RetrieverError(f"retriever {self.url}{route}: reply is not JSON") from None
            if reply.status_code != 200:
                detail = data.get("error") if isinstance(data, dict) else None
                raise RetrieverError(
                    f"retriever {self.url}{route}: HTTP {reply.status_code} {detail or ''}".rstrip()
                )
            return data
        raise RetrieverError(
            f"retriever {self.url}{route} did not answer after {self.retries + 1} tries ({last})"
        )

    def search(self, query: str, k: int) -> list[Hit]:
        data = self._request("POST", "/search", {"query": query, "k": k})
        try:
            return [Hit(str(p["id"]), str(p["text"]), float(p["score"])) for p in data["passages"]]
        except (KeyError, TypeError, ValueError):
            raise RetrieverError(f"retriever {self.url}/search: unexpected reply shape") from None

    def describe(self) -> dict[str, Any]:
        data = self._request("GET", "/health")
        return data if isinstance(data, dict) else {}

    def close(self) -> None:
        self._client.close()


def build_app(retriever: LocalRetriever, name: str) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    app = FastAPI(title="flywheel retriever", docs_url=None, redoc_url=None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"] if p != "body")
        return JSONResponse({"error": f"{where}: {first['msg']}"}, status_code=422)

    @app.get("/health")
    def health() -> dict[str, Any]:
        return {"status": "ok", "index": name, **retriever.describe()}

    # A plain def: FastAPI runs it in its thread pool, so searches do not block the event loop.
    @app.post("/search")
    def search(body: SearchRequest) -> dict[str, Any]:
        hits = retriever.search(body.query, body.k)
        return {"passages": [{"id": h.id, "text": h.text, "score": h.score} for h in hits]}

    return app


def resolve_index(index: str, cfg: Any) -> tuple[str, str]:
    """The folder an ``index`` argument names and its display name: an index artifact id of
    ``cfg``'s store, or an artifact folder."""
    from flywheel.store import ArtifactError, Store, check_plain

    path = Path(index)
    if path.is_dir():
        return str(path), path.resolve().name
    try:
        check_plain("", index)
    except ArtifactError:
        raise ValueError(f"no such folder: {index}") from None
    store = Store(cfg.run.store_root(), cfg.run.name)
    ref = store.get(index)
    if ref.kind != "index":
        raise ValueError(f"{index} is a {ref.kind} artifact, not an index artifact")
    return str(store.local_path(ref)), ref.id


def serve_retriever(folder: str, *, name: str, host: str = "127.0.0.1", port: int = 8100) -> int:
    """Serve the index in ``folder`` until SIGTERM or SIGINT; 0 once stopped."""
    import uvicorn

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(256)
    except OSError as err:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    try:
        try:
            retriever = load_retriever(folder)
        except RetrieverError as err:
            raise ValueError(str(err)) from None  # the command's one-line error
        shown = f"[{host}]" if ":" in host else host
        ready = (
            f"retriever: serving {name} ({len(retriever.passages)} passages) on "
            f"http://{shown}:{sock.getsockname()[1]}"
        )
        config = uvicorn.Config(
            build_app(retriever, name),
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = uvicorn.Server(config)

        def stop(signum: int, frame: Any) -> None:
            server.should_exit = True

        previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            print(ready, flush=True)  # the socket already accepts connections (they queue)
            server.run(sockets=[sock])
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        sock.close()
    return 0
