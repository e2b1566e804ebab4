"""In CI a PostgreSQL test that cannot reach its server fails; elsewhere it skips."""
from __future__ import annotations

import pytest

from tests.postgres_fixture import POSTGRES_URL_ENV, postgres_schema


@pytest.mark.parametrize("ci, outcome", [("true", pytest.fail.Exception),
                                         ("", pytest.skip.Exception)])
def test_missing_postgres_fails_in_ci_and_skips_elsewhere(monkeypatch, ci, outcome):
    monkeypatch.setenv("CI", ci)
    monkeypatch.delenv(POSTGRES_URL_ENV, raising=False)
    with pytest.raises(outcome, match=POSTGRES_URL_ENV):
        with postgres_schema():
            pass
