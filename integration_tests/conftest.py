"""Shared set-up of the integration tests (see tests/conftest.py)."""

from tests.conftest import pytest_collection_finish

__all__ = ["pytest_collection_finish"]
