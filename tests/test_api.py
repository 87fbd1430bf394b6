"""The public API: every exported name resolves, and importing featbake does not import torch."""

from __future__ import annotations

import subprocess
import sys

import featbake
from tests.conftest import REPO


def test_every_exported_name_resolves() -> None:
    assert set(featbake.__all__) == set(featbake._EXPORTS) | {"__version__"}
    for name in featbake.__all__:
        assert getattr(featbake, name) is not None, name


def test_views_dataset_is_public() -> None:
    """Issue 32 item 12: the README's ViewsDataset is importable from the package."""
    from featbake import ViewsDataset
    from featbake.serve.views import ViewsDataset as InModule

    assert ViewsDataset is InModule and "ViewsDataset" in featbake.__all__


def test_unknown_name_is_an_attribute_error() -> None:
    try:
        featbake.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("featbake.NoSuchThing resolved")


def test_import_and_cli_help_do_not_import_torch() -> None:
    code = (
        "import sys, featbake, featbake.cli; "
        "assert 'torch' not in sys.modules, 'torch imported'; print(featbake.__version__)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == featbake.__version__
