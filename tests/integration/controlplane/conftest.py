from tests.etcd_fixture import etcd, etcd_session  # noqa: F401  (pytest fixtures)
