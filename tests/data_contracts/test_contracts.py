"""The contracts themselves: each module's column table says what its schema holds, and the two
checks the store runs on every table (``validate_table``, ``table_from_rows``) refuse what does
not match with one line naming the column."""

from __future__ import annotations

import importlib
from types import ModuleType

import pyarrow as pa
import pytest

from data_contracts import CONTRACTS, SchemaError, table_from_rows, validate_table
from data_contracts.trajectories import MESSAGE

MODULES = ["checkpoints", "eval", "groups", "index", "pairs", "tasks", "trajectories", "trees"]


def _module(name: str) -> ModuleType:
    return importlib.import_module(f"data_contracts.{name}")


def _type_text(t: pa.DataType) -> str:
    """A type as the docstring tables write it: ``list<struct<role, content, loss>>``."""
    if pa.types.is_list(t):
        return f"list<{_type_text(t.value_type)}>"
    if pa.types.is_struct(t):
        return "struct<" + ", ".join(t.field(i).name for i in range(t.num_fields)) + ">"
    return str(t)  # string, int32, int64, double, float, bool


def _doc_columns(doc: str) -> list[tuple[str, str]]:
    """The (column, type) rows of the first Markdown table in a docstring."""
    rows = [line for line in doc.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in rows]
    assert cells[0][:2] == ["column", "type"], cells[0]
    return [(c[0], c[1]) for c in cells[2:]]  # past the header and its --- row


@pytest.mark.parametrize("name", MODULES)
def test_docstring_table_lists_the_schema(name: str) -> None:
    mod = _module(name)
    schema = mod.CONTRACT.schema
    expected = [(f.name, _type_text(f.type)) for f in schema]
    assert _doc_columns(mod.__doc__ or "") == expected
    assert mod.CONTRACT.version == mod.SCHEMA_VERSION >= 1


def test_every_contract_module_is_registered_under_its_kind() -> None:
    assert sorted(CONTRACTS) == sorted(_module(n).CONTRACT.kind for n in MODULES)
    for kind, contract in CONTRACTS.items():
        assert contract.kind == kind


def _task(**over: object) -> dict[str, object]:
    row: dict[str, object] = {
        "task_id": "arith-train-000001", "env": "arith", "split": "train", "seed": 7,
        "difficulty": 2, "prompt": "What is 2 + 3?", "answer": "5", "meta": "{}",
    }  # fmt: skip
    row.update(over)
    return row


def test_table_from_rows_builds_the_contract_schema() -> None:
    table = table_from_rows(CONTRACTS["tasks"], [_task(), _task(task_id="arith-val-000001")])
    assert table.schema.equals(CONTRACTS["tasks"].schema)
    assert table.column("task_id").to_pylist() == ["arith-train-000001", "arith-val-000001"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({k: v for k, v in _task().items() if k != "answer"}, "row 1 lacks column 'answer'"),
        (_task(extra=1), "row 1 has unexpected column 'extra'"),
        (_task(seed="seven"), "(tasks v1)"),
    ],
)
def test_table_from_rows_names_what_is_wrong(row: dict[str, object], message: str) -> None:
    with pytest.raises(SchemaError) as err:
        table_from_rows(CONTRACTS["tasks"], [_task(), row], where="tasks.jsonl")
    text = str(err.value)
    assert text.startswith("schema mismatch in tasks.jsonl: ") and "\n" not in text
    assert message in text


def test_validate_table_orders_columns_as_the_contract() -> None:
    contract = CONTRACTS["index"]
    table = pa.table({"text": ["a passage"], "id": ["p-1"], "title": ["P"]})
    out = validate_table(contract, table, "part-0.parquet")
    assert out.schema.names == ["id", "title", "text"]
    assert out.column("id").to_pylist() == ["p-1"]


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (
            pa.table({"id": ["p"], "title": ["P"]}),
            "missing column 'text' (expected string, index v1)",
        ),
        (
            pa.table({"id": ["p"], "title": ["P"], "text": [3]}),
            "column 'text' has type int64, expected string (index v1)",
        ),
        (
            pa.table({"id": ["p"], "title": ["P"], "text": ["t"], "score": [0.5]}),
            "unexpected column 'score' (index v1)",
        ),
    ],
)
def test_validate_table_refuses_a_mismatch(table: pa.Table, message: str) -> None:
    with pytest.raises(SchemaError, match="^schema mismatch in part-0.parquet: ") as err:
        validate_table(CONTRACTS["index"], table, "part-0.parquet")
    assert message in str(err.value)


def test_nested_message_type_is_checked_to_its_fields() -> None:
    """A messages column whose struct lacks ``loss`` is another type, not a near match."""
    contract = CONTRACTS["eval"]
    loose = pa.struct([("role", pa.string()), ("content", pa.string())])
    fields = [pa.field(f.name, pa.list_(loose) if f.name == "messages" else f.type)
              for f in contract.schema]  # fmt: skip
    table = pa.Table.from_pylist([], schema=pa.schema(fields))
    with pytest.raises(SchemaError, match="column 'messages' has type"):
        validate_table(contract, table, "eval")
    assert contract.schema.field("messages").type == pa.list_(MESSAGE)
    assert validate_table(contract, contract.schema.empty_table(), "eval").num_rows == 0
