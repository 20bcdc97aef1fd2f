"""``serve --api-key`` refuses at start, in one line that never shows the key, a key no HTTP client could
send (whitespace at its ends, a character outside printable ASCII) and an empty one (which meant no key)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from tensorrt_llm_ext.runtime.serve_cli import api_key_error


@pytest.mark.parametrize("key,words", [("secret ", "whitespace"), (" secret", "whitespace"), ("sec\tret", "U+0009"),
                                       ("sécret", "U+00E9"), ("key\u200b", "U+200B"), ("", "empty")],
                         ids=["trailing_space", "leading_space", "tab", "non_ascii", "zero_width", "empty"])
def test_unsendable_or_empty_keys_are_refused_naming_why(key, words):
    err = api_key_error(argparse.Namespace(api_key=key))
    assert err is not None and err.startswith("--api-key: ") and words in err, err
    assert key.strip() == "" or key.strip() not in err  # the key itself is never shown


def test_sendable_keys_and_no_key_pass():
    for key in ("sk-abc123", "a b", "~!@#$%^&*()_+", None):
        assert api_key_error(argparse.Namespace(api_key=key)) is None, key


def test_an_empty_environment_key_is_refused_as_an_empty_flag_is(monkeypatch):
    """``TLLM_EXT_API_KEY=""`` (say ``TLLM_EXT_API_KEY=$SECRET`` with ``SECRET`` unset) would serve without a key:
    refused as ``--api-key ""`` is; a flag overrides the variable; unset, there is no key."""
    import dataclasses

    from tensorrt_llm_ext import _env
    from tensorrt_llm_ext.runtime.serve_cli import api_key

    monkeypatch.setenv("TLLM_EXT_API_KEY", "")
    assert _env._read().api_key == ""  # read as given, not as "no key"
    monkeypatch.setattr(_env, "ENV", dataclasses.replace(_env.ENV, api_key=""))
    none = argparse.Namespace(api_key=None)
    assert api_key_error(none) == ("TLLM_EXT_API_KEY: empty (an empty key would mean no key: unset the variable to "
                                   "serve without one)")
    assert api_key_error(argparse.Namespace(api_key="sk-1")) is None and api_key(argparse.Namespace(api_key="sk-1")) == "sk-1"
    monkeypatch.setattr(_env, "ENV", dataclasses.replace(_env.ENV, api_key=None))
    assert api_key_error(none) is None and api_key(none) is None


def test_serve_with_a_trailing_space_in_the_key_exits_2_with_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TLLM_EXT_API_KEY"}
    r = subprocess.run([sys.executable, "-m", "tensorrt_llm_ext.cli", "serve", "--api-key", "sk-secret ",
                        "--port", "1"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert lines[-1].startswith("error: --api-key: the key starts or ends with whitespace"), r.stderr
    assert "Traceback" not in r.stderr and "sk-secret" not in r.stderr + r.stdout
