"""A real PostgreSQL for tests: one fresh schema per test in the throw-away database that
TOKENSERVE_TEST_POSTGRES_URL names (`.ci/run` starts a server and sets it).

Without the variable (or with the server down) the test skips, except in CI (CI=true),
where it fails: a PostgreSQL test that did not run is a defect there, not a pass.

    from tests.postgres_fixture import postgres_url  # noqa: F401  (pytest fixture)

`postgres_url_module` is the same for a whole module.

`postgres_url` is a postgresql:// URL whose search_path is the test's own schema, so a meter
process given that URL sees only this test's tables; the schema is dropped afterwards.
"""
from __future__ import annotations

import os
import uuid
from contextlib import contextmanager
from typing import Iterator
from urllib.parse import quote

import pytest

POSTGRES_URL_ENV = "TOKENSERVE_TEST_POSTGRES_URL"


def _unavailable(why: str):
    if os.environ.get("CI") == "true":
        pytest.fail(f"PostgreSQL is required in CI: {why}")
    pytest.skip(f"PostgreSQL not tested: {why}")


def _with_search_path(url: str, schema: str) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options={quote(f'-csearch_path={schema}')}"


@contextmanager
def postgres_schema() -> Iterator[str]:
    """A fresh schema in the test database; yields its URL, drops it afterwards."""
    base = os.environ.get(POSTGRES_URL_ENV)
    if not base:
        _unavailable(f"set {POSTGRES_URL_ENV}=postgresql://... to a throw-away database")
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(base, connect_timeout=3, autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
    except psycopg.OperationalError as e:
        _unavailable(f"the server at {POSTGRES_URL_ENV} is not reachable: {e}")
    try:
        yield _with_search_path(base, schema)
    finally:
        with psycopg.connect(base, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA {schema} CASCADE")


@pytest.fixture
def postgres_url():
    with postgres_schema() as url:
        yield url


@pytest.fixture(scope="module")
def postgres_url_module():
    """One schema for a whole test module (for a module-scoped service)."""
    with postgres_schema() as url:
        yield url
