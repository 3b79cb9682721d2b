from tests.server.conftest import toy_server  # noqa: F401 - the shared module-scoped server
