"""The private Keras and TensorFlow names ``pathnorm_tf`` uses: each one listed in
``pathnorm_tf/_private_api.py`` resolves on the installed versions (small models, no training
step), and the list matches the sources (the rule and the messages are tested in
``test_private_api.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("tensorflow")
pytest.importorskip("keras")

import pathnorm_tf
from pathnorm_tf import _private_api as api
from shared_spec.private_api import PrivateName, audit, problems, scan


@pytest.mark.parametrize("entry", api.ENTRIES, ids=lambda e: f"{e.library}:{e.name}")
def test_private_name_resolves(entry: PrivateName) -> None:
    assert not problems([entry], api.TESTED), "\n".join(problems([entry], api.TESTED))


def test_list_matches_sources() -> None:
    package = Path(pathnorm_tf.__file__).parent
    assert {"_flatten_layers", "_var_key", "__internal__"} <= {u.name for u in scan(package)}
    found = audit(package, api.ENTRIES, api.TESTED)
    assert not found, "\n".join(found)
