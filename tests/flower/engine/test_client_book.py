"""The contract of :class:`~pollen.strategies.lazy_book.ClientBook`: the lazy family's per-client vectors.

A book keeps, for each kind it was built with (of ``up-ref``, ``x``, ``c-prev``, ``error``), one float32
vector of length ``dim`` per client id, in RAM or in a file per kind under ``directory``. ``put`` stores a
vector (``None`` forgets that one), ``get`` returns a float32 copy (``None`` when the client has none),
``has`` and ``clients`` say who holds one, ``forget`` drops every vector of a client. A vector of another
length or with NaN/Inf is refused (``ValueError``) and nothing is stored. Its state saves every row and who
holds one; a bad saved state is a ``StateError`` naming the field, and the book is unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pollen.core.state_fields import StateError
from pollen.strategies.lazy_book import TABLES, ClientBook

pytestmark = pytest.mark.flower_compat

KINDS = ("x", "up-ref")


def test_a_kind_it_does_not_know_is_refused_naming_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match=r"bookkeeping kinds \['y'\] are unknown; allowed: up-ref, x, c-prev, error"):
        ClientBook(3, kinds=("x", "y"))
    assert set(ClientBook(3).tables) == set(TABLES)


def test_a_client_has_nothing_until_a_vector_is_put() -> None:
    book = ClientBook(3, kinds=KINDS)
    assert not book.has("x", "a") and book.get("x", "a") is None and book.clients("x") == 0


def test_put_stores_a_float32_copy_per_kind_and_get_returns_a_copy() -> None:
    book = ClientBook(3, kinds=KINDS)
    given = np.array([1.0, 2.0, 3.0])  # float64 in, float32 kept
    book.put("x", "a", given)
    given[0] = 99.0
    held = book.get("x", "a")
    assert held.dtype == np.float32
    np.testing.assert_array_equal(held, [1.0, 2.0, 3.0])
    held[1] = 99.0
    np.testing.assert_array_equal(book.get("x", "a"), [1.0, 2.0, 3.0])
    assert book.has("x", "a") and not book.has("up-ref", "a")
    assert (book.clients("x"), book.clients("up-ref")) == (1, 0)


def test_put_replaces_a_clients_vector_and_none_forgets_it() -> None:
    book = ClientBook(2, kinds=KINDS)
    book.put("x", "a", np.array([1.0, 2.0]))
    book.put("x", "a", np.array([5.0, 6.0]))
    np.testing.assert_array_equal(book.get("x", "a"), [5.0, 6.0])
    book.put("x", "a", None)
    assert not book.has("x", "a") and book.get("x", "a") is None


def test_forget_drops_every_vector_of_a_client_and_a_returning_client_starts_afresh() -> None:
    book = ClientBook(2, kinds=KINDS)
    book.put("x", "a", np.array([1.0, 2.0]))
    book.put("up-ref", "a", np.array([3.0, 4.0]))
    book.put("x", "b", np.array([7.0, 8.0]))
    book.forget("a")
    assert not book.has("x", "a") and not book.has("up-ref", "a") and book.has("x", "b")
    book.put("x", "a", np.array([9.0, 9.0]))
    np.testing.assert_array_equal(book.get("x", "a"), [9.0, 9.0])
    assert book.get("up-ref", "a") is None


@pytest.mark.parametrize(
    ("vector", "message"),
    [(np.array([1.0, 2.0]), r"update has shape \(2,\), expected \(3,\)"), (np.array([1.0, np.inf, 3.0]), "NaN or Inf")],
)
def test_a_vector_of_another_length_or_not_finite_is_refused_and_nothing_is_stored(vector, message: str) -> None:  # noqa: ANN001
    book = ClientBook(3, kinds=KINDS)
    book.put("x", "a", np.array([1.0, 2.0, 3.0]))
    with pytest.raises(ValueError, match=message):
        book.put("x", "a", vector)
    np.testing.assert_array_equal(book.get("x", "a"), [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=message):
        book.put("x", "b", vector)
    assert not book.has("x", "b")


def test_a_book_in_files_keeps_one_file_per_kind_and_the_same_values(tmp_path: Path) -> None:
    book = ClientBook(3, directory=tmp_path / "book", kinds=KINDS)
    book.put("x", "a", np.array([1.0, 2.0, 3.0]))
    assert sorted(p.name for p in (tmp_path / "book").iterdir()) == ["up-ref.f32", "x.f32"]
    np.testing.assert_array_equal(book.get("x", "a"), [1.0, 2.0, 3.0])
    assert book.memory_bytes() >= 3 * 4


# ---------------------------------------------------------------------------- state
def filled() -> ClientBook:
    book = ClientBook(3, kinds=KINDS)
    book.put("x", "a", np.array([1.0, 2.0, 3.0]))
    book.put("x", "b", np.array([4.0, 5.0, 6.0]))
    book.put("up-ref", "b", np.array([0.5, 0.25, 0.125]))
    book.forget("a")
    book.put("x", "c", np.array([7.0, 8.0, 9.0]))
    return book


def test_state_lists_who_holds_a_vector_of_each_kind() -> None:
    state = filled().state_dict()
    assert state["present"] == {"x": ["b", "c"], "up-ref": ["b"]}
    assert set(state["tables"]) == set(KINDS)


@pytest.mark.parametrize("in_files", [False, True], ids=["ram", "files"])
def test_state_round_trip_gives_every_client_the_same_vectors(in_files: bool, tmp_path: Path) -> None:
    book = filled()
    again = ClientBook(3, directory=tmp_path if in_files else None, kinds=KINDS)
    again.load_state_dict(book.state_dict())
    for kind in KINDS:
        for client in ("a", "b", "c", "d"):
            assert again.has(kind, client) == book.has(kind, client), (kind, client)
            if book.has(kind, client):
                np.testing.assert_array_equal(again.get(kind, client), book.get(kind, client))
    assert again.get("x", "a") is None  # forgotten stays forgotten


def with_present(**present: list[str]) -> dict:
    state = filled().state_dict()
    state["present"] = {**state["present"], **present}
    return state


@pytest.mark.parametrize(
    ("build", "field", "expected"),
    [
        (lambda: with_present(x=["b", "zz"]), "book/present/x", "names client 'zz', which has no row"),
        (lambda: ClientBook(4, kinds=KINDS).state_dict(), "book/tables/x/dim", "is 4; expected 3"),
        (lambda: ClientBook(3, kinds=("x",)).state_dict(), "book/tables/up-ref", "is missing"),
        (lambda: {"tables": filled().state_dict()["tables"]}, "book/present", "is missing"),
        (lambda: with_present(x="b"), "book/present/x", "expected a list"),
    ],
    ids=["present-without-row", "other-dim", "missing-kind", "no-present", "present-not-a-list"],
)
def test_a_bad_saved_book_is_refused_naming_the_field_and_the_book_is_unchanged(build, field, expected) -> None:  # noqa: ANN001
    book = filled()
    with pytest.raises(StateError, match=expected) as refused:
        book.load_state_dict(build())
    assert refused.value.field == field
    assert filled().state_dict()["present"] == book.state_dict()["present"]
    np.testing.assert_array_equal(book.get("x", "c"), [7.0, 8.0, 9.0])


def test_a_saved_row_that_is_not_finite_is_refused() -> None:
    state = filled().state_dict()
    data = np.array(state["tables"]["x"]["data"], copy=True)
    data.flat[0] = np.nan
    state["tables"]["x"] = {**state["tables"]["x"], "data": data}
    book = filled()
    with pytest.raises(StateError, match="at index 0; expected finite values") as refused:
        book.load_state_dict(state)
    assert refused.value.field == "book/tables/x/data"
    np.testing.assert_array_equal(book.get("x", "b"), [4.0, 5.0, 6.0])
