"""gyre-megatron refuses a megatron-core release it does not support at start, with one clear line."""

from __future__ import annotations

from pathlib import Path

import pytest

from gyre_megatron import preflight


@pytest.mark.parametrize("version", ["0.13.1", "0.14.0", "0.15.3", "0.16.1", "0.16.0rc2"])
def test_supported_releases_pass(version: str) -> None:
    assert preflight.megatron_core_problem(version) is None


@pytest.mark.parametrize("version", ["0.12.3", "0.17.0", "0.19.1", "1.0.0"])
def test_other_releases_are_refused_with_the_fix(version: str) -> None:
    line = preflight.megatron_core_problem(version)
    assert line is not None and version in line and "megatron-core>=0.13,<0.17" in line


def test_a_source_checkout_is_read_without_importing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    core = tmp_path / "megatron" / "core"
    core.mkdir(parents=True)
    (tmp_path / "megatron" / "__init__.py").write_text("")
    (core / "__init__.py").write_text("raise RuntimeError('importing megatron-core is not needed to read its version')\n")
    (core / "package_info.py").write_text("MAJOR = 0\nMINOR = 19\nPATCH = 0\nPRE_RELEASE = 'rc1'\n")
    import sys

    def ours() -> dict[str, object]:
        return {m: sys.modules.pop(m) for m in list(sys.modules) if m == "megatron" or m.startswith("megatron.")}

    real = ours()  # the installed megatron, if a test imported it: put back afterwards
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert preflight._located_megatron_core_version() == "0.19.0rc1"
        problems = preflight.training_side_problems(cells=1)
        assert any("megatron-core 0.19.0rc1" in p for p in problems), problems
    finally:
        ours()  # the fake package the lookups imported
        sys.modules.update(real)
