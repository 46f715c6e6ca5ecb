"""Parsers of untrusted files are bounded (depth, decompressed size, YAML aliases), secret draws reach past
the public sample (inside a declared domain), and settings that decide trust are what they say."""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import numpy as np
import pytest

from maxkernel.tools.readback import ReadBackError, bounded_json, bounded_yaml, load_arrays, pack_arrays
from maxkernel.tools.results import ArraySpec


def test_json_nested_past_the_bound_is_refused_unparsed() -> None:
    assert bounded_json(b'{"a": [1, {"b": "[[[[["}]}') == {"a": [1, {"b": "[[[[["}]}
    with pytest.raises(ReadBackError, match="nested deeper"):
        bounded_json(b"[" * 100_000 + b"]" * 100_000)


def test_an_npz_member_that_inflates_past_its_array_is_refused(tmp_path: Path) -> None:
    spec = {"c0s0o0": ArraySpec(shape=(4, 4), dtype="float32")}
    good = tmp_path / "good.npz"
    good.write_bytes(pack_arrays({"c0s0o0": np.ones((4, 4), np.float32)}))
    assert load_arrays(good, 1 << 20, spec)["c0s0o0"].sum() == 16
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("c0s0o0.npy", b"\0" * (64 << 20))  # 64 MiB of zeros: a few tens of KiB compressed
    bomb = tmp_path / "bomb.npz"
    bomb.write_bytes(buf.getvalue())
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(ReadBackError, match="decompresses to"):
        load_arrays(bomb, 1 << 20, spec)


def test_yaml_alias_bombs_and_deep_nesting_are_refused() -> None:
    assert bounded_yaml("a: &x [1, 2]\nb: *x\n") == {"a": [1, 2], "b": [1, 2]}
    bomb = "a0: &a0 [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 9)
    )
    with pytest.raises(ValueError, match="aliases"):
        bounded_yaml(bomb)
    with pytest.raises(ValueError, match="nests deeper"):
        bounded_yaml("a: " + "[" * 200 + "]" * 200)


def test_wide_draws_leave_the_sample_and_stay_in_the_domain() -> None:
    from maxkernel.tools import taskcode

    sample = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)
    like = taskcode.random_like(sample, np.random.default_rng(1))
    assert np.abs(like).max() <= np.abs(sample).max()  # the old family: inside the sample's range
    wide = taskcode.random_like(sample, np.random.default_rng(1), wide=True)
    assert (np.abs(wide) > 5).mean() > 0.05  # far past anything the public sample shows
    assert (wide == 0).any() and (wide == 1).any()  # special values
    inside = taskcode.random_like(sample, np.random.default_rng(1), wide=True, domain=(-1.0, 1.0))
    assert inside.min() >= -1 and inside.max() <= 1
    assert taskcode.input_domains({"input_domain": {"1": [0, 2]}}, 2) == [None, (0.0, 2.0)]
    assert taskcode.input_domains({"input_domain": [-1, 1]}, 2) == [(-1.0, 1.0), (-1.0, 1.0)]


def test_a_declared_input_domain_is_read_and_checked(tmp_path: Path) -> None:
    from maxkernel.tools.tasks import TaskError, _input_domain

    assert _input_domain([-1, 1]) == [-1.0, 1.0]
    assert _input_domain({0: [0, 1]}) == {0: [0.0, 1.0]}
    with pytest.raises(TaskError, match="lo must not exceed hi"):
        _input_domain([2, 1])
    with pytest.raises(TaskError, match="input_domain must be"):
        _input_domain("everywhere")


def test_a_chat_model_object_is_a_model_author() -> None:
    from langchain_core.language_models.fake_chat_models import FakeListChatModel

    from maxkernel.context import Context

    ctx = Context(chat_model=FakeListChatModel(responses=["x"]), model="offline")
    assert not ctx.is_offline and ctx.model != "offline" and ctx.model.startswith("chat_model:")
    assert Context(model="offline").is_offline


def test_fallback_readability_names_the_private_folder() -> None:
    import shutil
    import tempfile

    from maxkernel.tools.sandbox import _unreadable_by_others

    root = Path(tempfile.mkdtemp(dir="/tmp" if os.path.isdir("/tmp") else None))
    try:
        os.chmod(root, 0o755)
        if _unreadable_by_others(root) is not None:
            pytest.skip("the temp folder's own ancestors are private here")
        private = root / "private"
        (private / "venv").mkdir(parents=True)
        (private / "venv" / "jax.py").write_text("")
        os.chmod(private, 0o700)
        assert _unreadable_by_others(private / "venv" / "jax.py") == f"{private} (mode 0o700)"
        os.chmod(private, 0o755)
        assert _unreadable_by_others(private / "venv" / "jax.py") is None
    finally:
        shutil.rmtree(root)
