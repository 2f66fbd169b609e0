"""The private torch and Lightning names ``pathnorm_lightning`` uses: each one listed in
``pathnorm_lightning/_private_api.py`` resolves on the installed versions, and the sources use
no private name the list lacks (or the list names one the sources dropped)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")

import pathnorm_lightning
from pathnorm_lightning import _private_api
from shared_spec import private_api

PACKAGE = Path(pathnorm_lightning.__file__).parent


@pytest.mark.parametrize("entry", _private_api.ENTRIES, ids=lambda e: f"{e.library}:{e.name}")
def test_private_name_resolves(entry: private_api.PrivateName) -> None:
    found = private_api.problems([entry], _private_api.TESTED)
    assert not found, "\n".join(found)


def test_list_matches_sources() -> None:
    uses = private_api.scan(PACKAGE)
    assert {u.name for u in uses} >= {"_should_accumulate", "_parameters", "found_inf"}
    found = private_api.audit(PACKAGE, _private_api.ENTRIES, _private_api.TESTED)
    assert not found, "\n".join(found)
    assert private_api.audit(PACKAGE, _private_api.ENTRIES, {"torch": "2.13.0"}) == [
        "_private_api.py: TESTED has no version for lightning"
    ]


def test_check_names_the_moved_name_version_site_and_fix() -> None:
    moved = private_api.PrivateName(
        "torch",
        "_gone",
        "nn.Module._gone",
        ("pathnorm_lightning/hook.py:f",),
        "a reason",
        lambda: __import__("torch").nn.Module._gone,
    )
    with pytest.raises(private_api.PrivateAPIError) as info:
        private_api.check([moved, *_private_api.ENTRIES[:1]], {"torch": "2.13.0"})
    message = str(info.value)
    import torch

    assert message.count("\n") == 0  # only the moved entry
    for part in (
        f"torch {torch.__version__}",
        "nn.Module._gone no longer resolves (AttributeError",
        "pathnorm_lightning/hook.py:f (a reason)",
        "Tested with torch 2.13.0",
        "pip install 'torch==2.13.0'",
        "update the call site",
    ):
        assert part in message


def test_scan_rule(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text(
        "from tensorflow.python.ops import x\n"
        "from . import _own\n"
        "class C(Base):\n"
        "    _annotated: int\n"
        "    def _mine(self):\n"
        "        self._state = 1\n"
        "        return self._state, self._mine(), self._annotated, other._hidden\n"
        "    def _step(self):\n"
        "        super()._step()\n"
        "        return getattr(o, '_dyn', None), getattr(o, 'public'), opt.found_inf\n"
    )
    names = [(u.line, u.name) for u in private_api.scan(package)]
    assert names == [
        (1, "tensorflow.python.ops"),
        (7, "_annotated"),
        (7, "_hidden"),
        (9, "_step"),
        (10, "_dyn"),
        (10, "found_inf"),
    ]


def test_unlisted_and_stale_name_the_file_and_line() -> None:
    uses = private_api.scan(PACKAGE)
    first, rest = _private_api.ENTRIES[0], _private_api.ENTRIES[1:]
    site = next(u for u in uses if u.name == first.name)
    missing = private_api.unlisted(uses, rest)
    assert missing == [m for m in missing if m.startswith(f"{site.file}:")]
    assert f"{site.file}:{site.line}: the private name {first.name!r}" in missing[0]
    dropped = [u for u in uses if u.name != first.name]
    assert private_api.stale(dropped, _private_api.ENTRIES) == [
        f"_private_api.py lists {first.access} in {site.file}, which no longer uses "
        f"{first.name!r}: remove that call site from the entry (or the entry)."
    ]


def test_a_moved_lightning_name_fails_with_version_and_call_site(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import lightning
    from lightning.pytorch.loops.fit_loop import _FitLoop

    monkeypatch.delattr(_FitLoop, "_should_accumulate")
    found = private_api.problems(_private_api.ENTRIES, _private_api.TESTED)
    assert len(found) == 1
    assert found[0].startswith(
        f"lightning {lightning.__version__}: the private name "
        "trainer.fit_loop._should_accumulate() no longer resolves (AttributeError"
    )
    assert "pathnorm_lightning/callbacks.py:AfterOptimizerStep.on_train_batch_end" in found[0]
