from tests.etcd_fixture import etcd  # noqa: F401  (pytest fixture)
