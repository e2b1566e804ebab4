from tests.etcd_fixture import etcd_session  # noqa: F401  (pytest fixture)
from tests.postgres_fixture import postgres_url, postgres_url_module  # noqa: F401
