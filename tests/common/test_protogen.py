"""The committed gRPC stubs are what the .proto files generate."""

from services.common import protogen


def test_committed_stubs_are_fresh() -> None:
    assert protogen.stale_files() == [], "run `python -m services.common.protogen` and commit the stubs"
