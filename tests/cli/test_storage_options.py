"""`-o` storage options at the command line: an option that must be a mapping given as a string, and
one option given both whole and dotted, are usage errors naming the option."""

from __future__ import annotations

import pytest

from tests.cli_helpers import (
    one_line_error,
    usage_error,
)


@pytest.mark.parametrize("name", ["client_kwargs", "config_kwargs", "s3_additional_kwargs"])
def test_mapping_storage_options_given_as_a_string(name):
    line = one_line_error(["info", "s3://bkt/x", "-o", f"{name}=foo"], f"storage option '{name}' must be a mapping",
                          f"-o {name}.")
    assert "AttributeError" not in line


def test_storage_option_given_whole_and_dotted_is_a_usage_error():
    for args in (["-o", "client_kwargs=foo", "-o", "client_kwargs.endpoint_url=x"],
                 ["-o", "client_kwargs.endpoint_url=x", "-o", "client_kwargs=foo"]):
        assert "conflicts with" in usage_error(["info", "s3://bkt/x", *args])
