"""``wiki``: single- and multi-hop questions over a generated corpus, answered with a search tool.

The corpus is a made-up world, deterministic from ``corpus_seed``: countries, cities (one of
them each country's capital), people (born in a city) and organisations (founded by a person,
based in a city), with one short passage per entity. Questions ask one fact ("Where was X
born?") or chain two ("In which country was X born?": X's passage names the city, the city's
passage names the country). The agent searches and answers::

    suite = WikiSuite()
    task = suite.tasks("train", n=1, seed=0)[0]
    env = suite.make()
    obs = env.reset(task)                                        # the question
    obs, reward, done, info = env.step("<search>Aldric Venn</search>")   # top-k passages
    obs, reward, done, info = env.step("<answer>Morvast</answer>")       # reward = token F1
    env.close()

Reward is the token F1 of the answer against the gold (SQuAD normalisation: lowercase, no
punctuation, no articles); success is an exact match. ``info`` carries ``em`` and ``f1`` on the
answer step and, on every step, ``retrieved``: the ids of the passages retrieved so far (first
retrieval order, no repeats); ``Task.meta["gold_passages"]`` holds the passages that answer, so
recall@5 is computed from both (``flywheel.metrics.recall_at_k``; the evaluate stage reports it). Searches go to the index artifact in
``index_dir`` (the flow sets it from the ``index`` stage), to ``retriever_url`` (``flywheel
retriever serve``), or, with neither, to an index built in memory on first use. Facts are split
by a hash of (question kind, entity): every wording of a fact lands in the same split.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import string
import threading
from collections import Counter
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from flywheel.envs.base import Task
from flywheel.retrieval import (
    EmbedderSettings,
    IndexSettings,
    LocalRetriever,
    Passage,
    RemoteRetriever,
    Retriever,
    RetrieverError,
    check_embedder,
    load_retriever,
)

CORPUS_VERSION = 1  # bump when the generator's output changes: index artifact ids hash it
SPLIT_BUCKETS = {"test": (0,), "val": (1,), "train": (2, 3)}

INSTRUCTION = (
    "Answer the question about the world described by the wiki. Search it with "
    "<search>QUERY</search>: the best matching passages come back to you. Search for one "
    "name at a time. When you know the answer, reply with <answer>ANSWER</answer>."
)
INVALID = "Invalid action. Use <search>QUERY</search> to search or <answer>ANSWER</answer>."
# Reflection hints (ALGORITHMS.md, "Reflection by hint"): the opening of an assistant turn
# after a flawed step; the policy writes the rest of the turn (its search or answer).
HINTS = ("Wait, maybe I should rethink this question and conduct a new search.\n",)

_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr",
           "gr", "kr", "st", "tr", "th", "sh", "h", "j")  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "m", "nd", "rk", "th")
_COUNTRY_ENDS = ("ia", "land", "mark", "ora", "stan", "ania")
_CITY_ENDS = ("ford", "holm", "ton", "burg", "port", "vale", "wick", "by")
_ORG_KINDS = ("Guild", "Company", "Institute", "Society", "Bank", "Works", "Press", "Foundry")
_JOBS = ("painter", "engineer", "farmer", "poet", "sailor", "teacher", "merchant", "doctor",
         "architect", "baker", "weaver", "astronomer")  # fmt: skip

# kind -> (hops, wordings); {x} is the entity the question starts from.
QUESTIONS: dict[str, tuple[int, tuple[str, ...]]] = {
    "born": (1, ("Where was {x} born?", "In which city was {x} born?")),
    "city_country": (1, ("In which country is {x}?", "{x} is a city in which country?")),
    "capital": (1, ("What is the capital of {x}?", "Which city is the capital of {x}?")),
    "founder": (1, ("Who founded {x}?", "Who is the founder of {x}?")),
    "org_city": (1, ("Where is {x} based?", "In which city is {x} based?")),
    "birth_country": (
        2,
        ("In which country was {x} born?", "In which country is the city where {x} was born?"),
    ),
    "founder_birth": (
        2,
        ("Where was the founder of {x} born?", "In which city was the founder of {x} born?"),
    ),
    "org_country": (
        2,
        ("In which country is {x} based?", "In which country is the city where {x} is based?"),
    ),
}


# -- answer grading (SQuAD normalisation) -----------------------------------------------------

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and articles, collapse whitespace."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCT)).split())


def exact_match(prediction: str, gold: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(gold)


def token_f1(prediction: str, gold: str) -> float:
    """Token-overlap F1 of the normalised texts; 1.0 when both are empty, else 0.0 when one is."""
    pred, ref = normalize_answer(prediction).split(), normalize_answer(gold).split()
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


# -- the world --------------------------------------------------------------------------------


class _Names:
    """Made-up words, never the same twice in one world."""

    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set[str]()

    def stem(self, syllables: int) -> str:
        while True:
            word = "".join(
                self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) + self.rng.choice(_CODAS)
                for _ in range(syllables)
            ).capitalize()
            if 3 <= len(word) <= 9 and word not in self.used:
                self.used.add(word)
                return word


def build_world(
    seed: int, n_countries: int, cities_per_country: int, n_people: int, n_orgs: int
) -> dict[str, Any]:
    """Entities and their relations; names are unique words, so every fact has one answer."""
    rng = random.Random(f"wiki/world/{seed}")
    names = _Names(rng)
    countries = [names.stem(2) + rng.choice(_COUNTRY_ENDS) for _ in range(n_countries)]
    cities = []
    for country in countries:
        for i in range(cities_per_country):
            name = names.stem(rng.choice((1, 2))) + rng.choice(_CITY_ENDS)
            cities.append({"name": name, "country": country, "capital": i == 0})
    people = [
        {
            "name": f"{names.stem(rng.choice((1, 2)))} {names.stem(2)}",
            "job": rng.choice(_JOBS),
            "born": rng.choice(cities)["name"],
        }
        for _ in range(n_people)
    ]
    founders = rng.sample(range(n_people), n_orgs)
    orgs = [
        {
            "name": f"{names.stem(2)} {rng.choice(_ORG_KINDS)}",
            "founder": people[f]["name"],
            "based": rng.choice(cities)["name"],
        }
        for f in founders
    ]
    return {"countries": countries, "cities": cities, "people": people, "orgs": orgs}


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def passages_of(world: dict[str, Any]) -> list[Passage]:
    """One passage per entity: people, organisations, cities, countries."""
    capital = {c["country"]: c["name"] for c in world["cities"] if c["capital"]}
    out = [
        Passage(
            f"person-{i:04d}",
            p["name"],
            f"{p['name']} is {_article(p['job'])} {p['job']}. {p['name']} was born in {p['born']}.",
        )
        for i, p in enumerate(world["people"])
    ]
    out += [
        Passage(
            f"org-{i:04d}",
            o["name"],
            f"{o['name']} was founded by {o['founder']}. {o['name']} is based in {o['based']}.",
        )
        for i, o in enumerate(world["orgs"])
    ]
    out += [
        Passage(
            f"city-{i:04d}",
            c["name"],
            f"{c['name']} is the capital of {c['country']}."
            if c["capital"]
            else f"{c['name']} is a city in {c['country']}.",
        )
        for i, c in enumerate(world["cities"])
    ]
    out += [
        Passage(
            f"country-{i:04d}",
            k,
            f"{k} is a country. The capital of {k} is {capital[k]}.",
        )
        for i, k in enumerate(world["countries"])
    ]
    return out


def facts_of(world: dict[str, Any], passages: list[Passage]) -> list[dict[str, Any]]:
    """Every question kind on every entity it applies to: the entity, the answer, the gold
    passages and the oracle's queries (the names to search, in order)."""
    pid = {p.title: p.id for p in passages}
    city_country = {c["name"]: c["country"] for c in world["cities"]}
    capital = {c["country"]: c["name"] for c in world["cities"] if c["capital"]}
    born = {p["name"]: p["born"] for p in world["people"]}

    def fact(kind: str, x: str, answer: str, chain: list[str]) -> dict[str, Any]:
        return {"kind": kind, "x": x, "answer": answer, "queries": chain,
                "gold": [pid[name] for name in chain]}  # fmt: skip

    out = []
    for p in world["people"]:
        out.append(fact("born", p["name"], p["born"], [p["name"]]))
        out.append(
            fact("birth_country", p["name"], city_country[p["born"]], [p["name"], p["born"]])
        )
    for c in world["cities"]:
        out.append(fact("city_country", c["name"], c["country"], [c["name"]]))
    for k in world["countries"]:
        out.append(fact("capital", k, capital[k], [k]))
    for o in world["orgs"]:
        out.append(fact("founder", o["name"], o["founder"], [o["name"]]))
        out.append(fact("org_city", o["name"], o["based"], [o["name"]]))
        out.append(fact("founder_birth", o["name"], born[o["founder"]], [o["name"], o["founder"]]))
        out.append(
            fact("org_country", o["name"], city_country[o["based"]], [o["name"], o["based"]])
        )
    return out


def split_of(kind: str, entity: str) -> str:
    bucket = hashlib.sha256(f"{kind}/{entity}".encode()).digest()[0] % 4
    return next(split for split, buckets in SPLIT_BUCKETS.items() if bucket in buckets)


# -- the suite --------------------------------------------------------------------------------


class WikiOptions(BaseModel):
    """The options of ``envs.<name>.options`` for wiki, checked before any work starts."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    corpus_seed: int = Field(default=0, ge=0, description="Seed of the generated world.")
    n_countries: int = Field(default=8, ge=2, le=500, description="Countries in the world.")
    cities_per_country: int = Field(default=4, ge=1, le=50, description="Cities per country.")
    n_people: int = Field(default=160, ge=2, le=20000, description="People in the world.")
    n_orgs: int = Field(default=48, ge=1, le=20000, description="Organisations (<= n_people).")
    hop_weights: tuple[float, float] = Field(
        default=(1.0, 1.0), description="Relative frequency of 1-hop and 2-hop questions."
    )
    k: int = Field(default=3, ge=1, le=20, description="Passages a search returns.")
    embedder: EmbedderSettings = Field(
        default_factory=EmbedderSettings, description="How passages and queries are embedded."
    )
    index: IndexSettings = Field(default_factory=IndexSettings, description="The FAISS index.")
    index_dir: str | None = Field(
        default=None,
        description="An index artifact folder to search (the flow sets it from the index stage).",
    )
    retriever_url: str | None = Field(
        default=None, description="A `flywheel retriever serve` URL to search instead."
    )
    retriever_timeout_s: float = Field(default=10.0, gt=0, description="Seconds per request.")
    retriever_retries: int = Field(default=2, ge=0, description="Retries of a failed request.")

    @field_validator("hop_weights")
    @classmethod
    def _weights(cls, weights: tuple[float, float]) -> tuple[float, float]:
        if min(weights) < 0 or not sum(weights):
            raise ValueError(f"needs 2 weights >= 0, not all 0, got {list(weights)}")
        return weights

    @field_validator("retriever_url")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        if url is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", url):
            raise ValueError(f"{url!r} is not an http(s) URL")
        return url

    @field_validator("n_orgs")
    @classmethod
    def _orgs(cls, n_orgs: int, info: ValidationInfo) -> int:
        people = info.data.get("n_people")
        if people is not None and n_orgs > people:  # every organisation has its own founder
            raise ValueError(f"must be <= n_people ({people})")
        return n_orgs


class WikiSuite:
    """Task generator, oracle and episode factory of the ``wiki`` environment; the options are
    those of ``WikiOptions``. The world is built on first use and the retriever is opened once
    per suite, then shared by its episodes."""

    name = "wiki"
    instruction = INSTRUCTION
    hints = HINTS  # how a reflection turn opens (stage reflect)
    Options = WikiOptions  # make_suite checks envs.<name>.options against it

    def __init__(self, **options: Any) -> None:
        self.opts = WikiOptions.model_validate(options)
        if self.opts.retriever_url is None:  # this process embeds queries: refuse before any work
            check_embedder(self.opts.embedder)
        self._world: dict[str, Any] | None = None
        self._passages: list[Passage] | None = None
        self._retriever: Retriever | None = None
        self._lock = threading.Lock()

    # -- corpus and index ----------------------------------------------------------------------
    def corpus_settings(self) -> dict[str, Any]:
        o = self.opts
        return {"generator": "wiki", "version": CORPUS_VERSION, "seed": o.corpus_seed,
                "n_countries": o.n_countries, "cities_per_country": o.cities_per_country,
                "n_people": o.n_people, "n_orgs": o.n_orgs}  # fmt: skip

    def index_config(self) -> dict[str, Any]:
        """What the ``index`` stage's artifact id hashes: the corpus and the embedder and index
        settings (not ``gpu``: where a search runs does not change the index)."""
        return {
            "corpus": self.corpus_settings(),
            "embedder": self.opts.embedder.model_dump(mode="json"),
            "index": self.opts.index.model_dump(mode="json", exclude={"gpu"}),
        }

    @property
    def needs_index(self) -> bool:
        """Whether the ``index`` stage should build this suite's index (no index given)."""
        return self.opts.index_dir is None and self.opts.retriever_url is None

    def world(self) -> dict[str, Any]:
        if self._world is None:
            o = self.opts
            self._world = build_world(
                o.corpus_seed, o.n_countries, o.cities_per_country, o.n_people, o.n_orgs
            )
        return self._world

    def corpus(self) -> list[Passage]:
        if self._passages is None:
            self._passages = passages_of(self.world())
        return self._passages

    def retriever(self) -> Retriever:
        """The index artifact, the server, or an index built in memory; opened once."""
        with self._lock:
            if self._retriever is None:
                self._retriever = self._open_retriever()
            return self._retriever

    def _open_retriever(self) -> Retriever:
        o = self.opts
        if o.retriever_url is not None:
            remote = RemoteRetriever(
                o.retriever_url, timeout_s=o.retriever_timeout_s, retries=o.retriever_retries
            )
            self._check_corpus(remote.describe().get("config"), o.retriever_url)
            return remote
        if o.index_dir is not None:
            local = load_retriever(o.index_dir, gpu=o.index.gpu)
            self._check_corpus(local.config, o.index_dir)
            return local
        return LocalRetriever.build(self.corpus(), o.embedder, o.index, self.index_config())

    def _check_corpus(self, config: Any, where: str) -> None:
        # Gold passage ids only mean something in the index of this very corpus.
        held = config.get("corpus") if isinstance(config, dict) else None
        want = json.loads(json.dumps(self.corpus_settings()))
        if held != want:
            raise RetrieverError(
                f"{where} holds an index of another corpus ({held}); this env's is {want}"
            )

    # -- the suite protocol --------------------------------------------------------------------
    def tasks(self, split: str, n: int, seed: int) -> list[Task]:
        """``n`` distinct questions of ``split``; a prefix of a longer call."""
        if split not in SPLIT_BUCKETS:
            raise ValueError(f"unknown split {split!r}; expected one of {sorted(SPLIT_BUCKETS)}")
        pools: dict[int, list[tuple[dict[str, Any], str]]] = {1: [], 2: []}
        for fact in facts_of(self.world(), self.corpus()):
            if split_of(fact["kind"], fact["x"]) == split:
                hops, wordings = QUESTIONS[fact["kind"]]
                pools[hops].extend((fact, w.format(x=fact["x"])) for w in wordings)
        available = len(pools[1]) + len(pools[2])
        if n > available:
            raise ValueError(
                f"{self.name}: the corpus has {available} {split} questions, {n} asked "
                f"(lower envs.{self.name}.n_{split} or raise options n_people / n_orgs)"
            )
        rng = random.Random(f"wiki/{split}/{seed}")
        for pool in pools.values():
            rng.shuffle(pool)
        tasks: list[Task] = []
        while len(tasks) < n:
            hops = rng.choices((1, 2), weights=self.opts.hop_weights)[0]
            if not pools[hops]:
                hops = 3 - hops  # one kind ran out: the other fills the rest
            fact, prompt = pools[hops].pop()
            tasks.append(
                Task(
                    task_id=f"{self.name}-{split}-{len(tasks):06d}",
                    env=self.name,
                    split=split,
                    seed=seed,
                    difficulty=hops,
                    prompt=prompt,
                    answer=fact["answer"],
                    meta={
                        "kind": fact["kind"],
                        "queries": fact["queries"],
                        "gold_passages": fact["gold"],
                    },
                )
            )
        return tasks

    def expert(self, task: Task) -> list[str]:
        """Search each name of the chain in turn (the entity, then the one its passage names),
        then answer."""
        searches = [f"<search>{q}</search>" for q in task.meta["queries"]]
        return [*searches, f"<answer>{task.answer}</answer>"]

    def make(self) -> WikiEnv:
        return WikiEnv(self.retriever, k=self.opts.k)


_CLOSED_TAG = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)
# An engine that stops on "</search>" may strip the stop string: accept a trailing open tag.
_OPEN_TAG = re.compile(r"<(search|answer)>((?:(?!<(?:search|answer)>).)*)\Z", re.DOTALL)


def parse_action(action: str) -> tuple[str, str] | None:
    """The last ``<search>`` or ``<answer>`` tag as (tag, content), or None."""
    closed = list(_CLOSED_TAG.finditer(action))
    tail = _OPEN_TAG.search(action, closed[-1].end() if closed else 0)
    match = tail or (closed[-1] if closed else None)
    if match is None or not match.group(2).strip():
        return None
    return match.group(1), match.group(2).strip()


class WikiEnv:
    """One ``wiki`` episode at a time. ``retriever`` is called on the first search, so making
    an env costs nothing; a retriever that fails raises (the episode ends as an error, not as
    the agent's mistake)."""

    def __init__(self, retriever: Any, k: int = 3) -> None:
        self._open, self.k = retriever, k
        self._task: Task | None = None
        self._done = False
        self._retrieved: list[str] = []

    def reset(self, task: Task) -> str:
        self._task, self._done, self._retrieved = task, False, []
        return task.prompt

    def step(self, action: str) -> tuple[str, float, bool, dict[str, Any]]:
        if self._task is None:
            raise RuntimeError("WikiEnv.step() before reset()")
        if self._done:
            raise RuntimeError(f"episode {self._task.task_id} is done; call reset() first")
        info: dict[str, Any] = {"tool_call": False, "tool_error": False, "tool_ok": False}
        info.update(invalid=False, success=False)
        parsed = parse_action(action)
        if parsed is None:
            info.update(invalid=True, retrieved=list(self._retrieved))
            return INVALID, 0.0, False, info
        tag, content = parsed
        if tag == "answer":
            self._done = True
            f1, em = token_f1(content, self._task.answer), exact_match(content, self._task.answer)
            info.update(success=em, em=em, f1=f1, retrieved=list(self._retrieved))
            return "Done.", f1, True, info
        hits = self._open().search(content, self.k)
        self._retrieved.extend(h.id for h in hits if h.id not in self._retrieved)
        info.update(tool_call=True, tool_ok=bool(hits), retrieved=list(self._retrieved))
        observation = "\n".join(h.text for h in hits) or "No passage found."
        return observation, 0.0, False, info

    def snapshot(self) -> dict[str, Any]:
        return {"task": self._task, "done": self._done, "retrieved": list(self._retrieved)}

    def restore(self, state: dict[str, Any]) -> None:
        self._task, self._done = state["task"], state["done"]
        self._retrieved = list(state["retrieved"])

    def close(self) -> None:
        self._task, self._done, self._retrieved = None, False, []
